"""An in-memory ShardStore: the reference the LMDB store is held to by the
contract tests, and a fast store for model-based tests of the domain."""

from __future__ import annotations

import bisect

from shard_server.domain.events import DeliveryChanged, Event
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord


class MemoryShardStore:
    def __init__(self) -> None:
        self.records: dict[int, MessageRecord] = {}
        self.deliveries: dict[int, Delivery] = {}
        self.index: list[tuple[int, int]] = []  # sorted (visible_at_ms, seq)
        self.dead_letters: list[int] = []  # sorted seqs
        self.dedup: dict[str, tuple[int, int, int]] = {}
        self.groups: dict[str, list[int]] = {}
        self.events: list[Event] = []
        self._last_seq = 0

    def get_record(self, seq: int) -> MessageRecord | None:
        return self.records.get(seq)

    def get_delivery(self, seq: int) -> Delivery | None:
        return self.deliveries.get(seq)

    def eligible(self, now_ms: int, *, after: tuple[int, int] | None, limit: int) -> list[tuple[int, int]]:
        start = 0 if after is None else bisect.bisect_right(self.index, after)
        found: list[tuple[int, int]] = []
        for key in self.index[start:]:
            if key[0] > now_ms or len(found) >= limit:
                break
            found.append(key)
        return found

    def eligible_by_priority(
        self, now_ms: int, *, after: tuple[int, int, int] | None, limit: int
    ) -> list[tuple[int, int, int]]:
        # Built from the deliveries themselves: the reference for the LMDB store's own index.
        keys = sorted(
            (255 - delivery.priority, delivery.visible_at_ms, seq)
            for seq, delivery in self.deliveries.items()
            if delivery.indexed and delivery.priority and delivery.visible_at_ms <= now_ms
        )
        start = 0 if after is None else bisect.bisect_right(keys, after)
        return keys[start : start + limit]

    def oldest_messages(self, *, after_seq: int, limit: int) -> list[tuple[int, int]]:
        seqs = sorted(seq for seq in self.deliveries if seq > after_seq)[:limit]
        return [(seq, self.deliveries[seq].sent_at_ms) for seq in seqs]

    def message_count(self) -> int:
        return len(self.records)

    def last_seq(self) -> int:
        return self._last_seq

    def dedup_lookup(self, dedup_id: str) -> tuple[int, int, int] | None:
        return self.dedup.get(dedup_id)

    def first_group_member(self, group_id: str) -> int | None:
        members = self.groups.get(group_id)
        return members[0] if members else None

    def dead_letter_pending(self, *, limit: int) -> list[int]:
        return self.dead_letters[:limit]

    def put_record(self, record: MessageRecord) -> None:
        self.records[record.seq] = record

    def delete_record(self, seq: int) -> None:
        self.records.pop(seq, None)

    def _unlink(self, delivery: Delivery) -> None:
        if delivery.indexed:
            key = (delivery.visible_at_ms, delivery.seq)
            position = bisect.bisect_left(self.index, key)
            if position < len(self.index) and self.index[position] == key:
                del self.index[position]
        elif delivery.state == DeliveryState.DEAD_LETTER_PENDING and delivery.seq in self.dead_letters:
            self.dead_letters.remove(delivery.seq)

    def put_delivery(self, delivery: Delivery, *, previous: Delivery | None) -> None:
        if previous is not None:
            self._unlink(previous)
        self.deliveries[delivery.seq] = delivery
        if delivery.indexed:
            bisect.insort(self.index, (delivery.visible_at_ms, delivery.seq))
        elif delivery.state == DeliveryState.DEAD_LETTER_PENDING:
            bisect.insort(self.dead_letters, delivery.seq)

    def delete_delivery(self, delivery: Delivery) -> None:
        self._unlink(delivery)
        self.deliveries.pop(delivery.seq, None)

    def put_dedup(self, dedup_id: str, *, seq: int, sent_at_ms: int, expires_at_ms: int) -> None:
        self.dedup[dedup_id] = (seq, sent_at_ms, expires_at_ms)

    def prune_dedup(self, *, up_to_ms: int) -> None:
        self.dedup = {key: value for key, value in self.dedup.items() if value[2] > up_to_ms}

    def add_group_member(self, group_id: str, seq: int) -> None:
        bisect.insort(self.groups.setdefault(group_id, []), seq)

    def remove_group_member(self, group_id: str, seq: int) -> None:
        members = self.groups.get(group_id, [])
        if seq in members:
            members.remove(seq)
        if not members:
            self.groups.pop(group_id, None)

    def set_last_seq(self, seq: int) -> None:
        self._last_seq = seq

    def clear_messages(self) -> None:
        self.records.clear()
        self.deliveries.clear()
        self.index.clear()
        self.dead_letters.clear()
        self.groups.clear()

    def record_event(self, event: Event) -> None:
        self.events.append(event)

    def record_delivery_change(self, event: DeliveryChanged, *, previous: Delivery) -> None:
        self.record_event(event)
        self.put_delivery(event.delivery, previous=previous)
