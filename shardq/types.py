"""What the client hands to and gets from a queue: plain dataclasses, no protobuf."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    body: bytes
    attributes: dict[str, str] = dataclasses.field(default_factory=dict)
    group_id: str = ""
    dedup_id: str = ""
    # None: the queue's delivery delay.
    delay_ms: int | None = None
    # Its priority lane: 0 (the default) to the queue's priorityLanes - 1, highest first.
    priority: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SendResult:
    message_id: str
    duplicate: bool
    shard: int
    seq: int
    # Set when this message was not stored (e.g. QUEUE_FULL on its shard).
    error_reason: str = ""
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_reason


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class ReceivedMessage:
    message_id: str
    body: bytes
    attributes: dict[str, str]
    group_id: str
    dedup_id: str
    receipt: str
    receive_count: int
    sent_at_ms: int
    first_received_at_ms: int
    visible_until_ms: int
    shard: int
    seq: int
    priority: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EntryResult:
    ok: bool
    reason: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardAttributes:
    shard: int
    visible: int
    in_flight: int
    delayed: int
    dead_letter_pending: int
    oldest_sent_at_ms: int
    commit_index: int
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class QueueAttributes:
    queue: str
    visible: int
    in_flight: int
    delayed: int
    dead_letter_pending: int
    oldest_sent_at_ms: int
    oldest_age_ms: int
    shards: list[ShardAttributes]
    # Shards the totals leave out: their leader did not answer in time, or none is known
    # (for a moment after a leader dies). The totals then read low.
    uncounted_shards: tuple[int, ...] = ()
    # The queue's settings, as `queue_settings` gives them (the same answer carries them).
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether the totals count every shard of the queue."""
        return not self.uncounted_shards


@dataclasses.dataclass(frozen=True, slots=True)
class ShardRoute:
    shard: int
    leader_address: str
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class RedriveProgress:
    moved: int
    remaining: int
    done: bool
    # Without a destination: messages left in the source, since no queue that sends its
    # dead letters there is theirs (sent to it directly, or their queue since changed).
    kept: int = 0
