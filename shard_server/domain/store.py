"""What the state machine needs from storage, as a protocol.

The LMDB store and the in-memory store both implement it and pass the same
contract tests. Write methods are called only from `applying.apply_event`, so
a follower replaying the log performs exactly the leader's mutations.
"""

from __future__ import annotations

from typing import Protocol

from shard_server.domain.events import DeliveryChanged, Event
from shard_server.domain.messages import Delivery, MessageRecord


class ShardStore(Protocol):
    # -- reads -------------------------------------------------------------
    def get_record(self, seq: int) -> MessageRecord | None: ...

    def get_delivery(self, seq: int) -> Delivery | None: ...

    def eligible(self, now_ms: int, *, after: tuple[int, int] | None, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` (visible_at_ms, seq) index keys with visible_at_ms <= now_ms,
        ascending, strictly after `after`."""
        ...

    def eligible_by_priority(
        self, now_ms: int, *, after: tuple[int, int, int] | None, limit: int
    ) -> list[tuple[int, int, int]]:
        """Up to `limit` (255 - priority, visible_at_ms, seq) keys of indexed messages of a
        priority above 0 with visible_at_ms <= now_ms, ascending (highest lane first, then
        as `eligible` orders them), strictly after `after`."""
        ...

    def oldest_messages(self, *, after_seq: int, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` (seq, sent_at_ms) in seq order, seq > after_seq."""
        ...

    def message_count(self) -> int: ...

    def last_seq(self) -> int: ...

    def dedup_lookup(self, dedup_id: str) -> tuple[int, int, int] | None:
        """(seq, sent_at_ms, expires_at_ms) of the message first sent with this id."""
        ...

    def first_group_member(self, group_id: str) -> int | None:
        """Lowest seq still stored for the FIFO group."""
        ...

    def dead_letter_pending(self, *, limit: int) -> list[int]:
        """Seqs waiting to be handed to the dead-letter queue, oldest first."""
        ...

    # -- writes (only from applying.apply_event) ---------------------------
    def put_record(self, record: MessageRecord) -> None: ...

    def delete_record(self, seq: int) -> None: ...

    def put_delivery(self, delivery: Delivery, *, previous: Delivery | None) -> None:
        """Store the delivery state and move its index / outbox key to match."""
        ...

    def delete_delivery(self, delivery: Delivery) -> None: ...

    def put_dedup(self, dedup_id: str, *, seq: int, sent_at_ms: int, expires_at_ms: int) -> None: ...

    def prune_dedup(self, *, up_to_ms: int) -> None:
        """Drop dedup entries that expire at or before up_to_ms."""
        ...

    def add_group_member(self, group_id: str, seq: int) -> None: ...

    def remove_group_member(self, group_id: str, seq: int) -> None: ...

    def set_last_seq(self, seq: int) -> None: ...

    def clear_messages(self) -> None:
        """Remove every message, delivery state, index key and group member (purge)."""
        ...

    def record_event(self, event: Event) -> None:
        """Add the event to the log entry this transaction writes."""
        ...

    def record_delivery_change(self, event: DeliveryChanged, *, previous: Delivery) -> None:
        """record_event(event), then put_delivery(event.delivery, previous=previous), in one
        step: what committing a delivery change comes to (once per message a receive claims)."""
        ...
