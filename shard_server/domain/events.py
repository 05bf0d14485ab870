"""Log events: the decisions a leader made, replayed identically by followers.

Every state change of a shard is one of these, written to the shard's log in
the same transaction as its effect. Applying an event makes no decision.
"""

from __future__ import annotations

import dataclasses
import enum

from shard_server.domain.messages import Delivery, MessageRecord


class ChangeKind(enum.IntEnum):
    """Why a delivery state changed. Stored on disk: numbers fixed forever."""

    RECEIVED = 1
    VISIBILITY_CHANGED = 2
    RELEASED = 3
    DEAD_LETTERED = 4


class RemovalKind(enum.IntEnum):
    """Why a message left the shard. Stored on disk: numbers fixed forever."""

    DELETED = 1
    EXPIRED = 2
    DEAD_LETTER_DELIVERED = 3


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class Sent:
    record: MessageRecord
    delivery: Delivery
    # 0 when the message has no dedup id or the window is 0.
    dedup_expires_at_ms: int


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class DeliveryChanged:
    kind: ChangeKind
    delivery: Delivery
    reason: str = ""


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class Removed:
    kind: RemovalKind
    seq: int
    sent_at_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Purged:
    up_to_seq: int
    count: int


@dataclasses.dataclass(frozen=True, slots=True)
class DedupPruned:
    up_to_ms: int


Event = Sent | DeliveryChanged | Removed | Purged | DedupPruned


@dataclasses.dataclass(frozen=True, slots=True)
class LogEntry:
    epoch: int
    index: int
    at_ms: int
    events: tuple[Event, ...]
