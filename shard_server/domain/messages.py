"""What a shard stores per message: the immutable record and the delivery state."""

from __future__ import annotations

import dataclasses
import enum


class DeliveryState(enum.IntEnum):
    """Stored on disk: the numbers are fixed forever and never reused."""

    # In the delivery index: visible when visible_at_ms <= now, delayed otherwise.
    READY = 0
    # In the delivery index under its claim deadline: in flight.
    CLAIMED = 1
    # FIFO only: behind its group's head, not in the delivery index yet.
    WAITING_IN_GROUP = 2
    # Past max receive count: waiting to be handed to the dead-letter queue.
    DEAD_LETTER_PENDING = 3


# An enum member read from its class costs about 60 ns (Python 3.11), four times the
# comparison itself; module constants hold the ones the hot paths compare against.
_LAST_INDEXED = DeliveryState.CLAIMED


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class MessageRecord:
    seq: int
    sent_at_ms: int
    body: bytes
    attributes: dict[str, str]
    group_id: str
    dedup_id: str
    # For messages that arrived by dead-lettering or redrive: the queue they left.
    source_queue: str = ""


# A message's claim tokens count up from its send time in milliseconds times this. They
# once counted from 0, and a receipt names (shard, seq, epoch, token): a queue deleted
# and created again under the same name numbers its messages from 1 again, so a receipt
# of the old queue's first claim held the new queue's first claim, and deleted it.
# Messages sent in different milliseconds now never share a token (below 65,536
# receives each).
CLAIM_TOKENS_PER_MS = 1 << 16


def first_claim_token(sent_at_ms: int) -> int:
    """The claim token a message holds before its first claim (which takes the next)."""
    return sent_at_ms * CLAIM_TOKENS_PER_MS


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class Delivery:
    seq: int
    state: DeliveryState
    sent_at_ms: int
    visible_at_ms: int
    receive_count: int = 0
    first_received_at_ms: int = 0
    last_received_at_ms: int = 0
    claim_epoch: int = 0
    claim_token: int = 0
    # Why the message was last released (nack), if the releaser said: carried to
    # its dead-letter copy, so a job queue's last error is not lost.
    last_error: str = ""
    # Its priority lane (0 unless the queue has lanes): fixed at its send.
    priority: int = 0

    @property
    def indexed(self) -> bool:
        # READY (0) or CLAIMED (1): one int comparison, asked several times per message.
        return self.state <= _LAST_INDEXED


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class NewMessage:
    """A validated message to store; delay already resolved against the queue default."""

    body: bytes
    attributes: dict[str, str]
    group_id: str
    dedup_id: str
    delay_ms: int
    source_queue: str = ""
    priority: int = 0


def format_message_id(*, sent_at_ms: int, shard: int, seq: int) -> str:
    """Time-ordered and unique within a queue: sorting ids sorts by send time."""
    return "%012x%04x%016x" % (sent_at_ms, shard, seq)  # noqa: UP031  # twice as fast as the f-string


def parse_message_id(message_id: str) -> tuple[int, int, int]:
    """(sent_at_ms, shard, seq) from a message id; ValueError if it is not one."""
    if len(message_id) != 32:
        raise ValueError(f"message id {message_id!r} has the wrong length")
    return int(message_id[:12], 16), int(message_id[12:16], 16), int(message_id[16:], 16)
