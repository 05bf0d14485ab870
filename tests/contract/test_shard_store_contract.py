"""One contract for every ShardStore: the LMDB store must behave like the in-memory one.

Subclass StoreContract and provide `store`; every test runs on each implementation.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from shard_server.domain.applying import apply_event
from shard_server.domain.events import ChangeKind, DedupPruned, DeliveryChanged, Purged, RemovalKind, Removed, Sent
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord
from shard_server.domain.store import ShardStore
from shard_server.storage.lmdb_store import ShardEnvironment
from shard_server.storage.memory import MemoryShardStore


def sent(
    seq: int, *, at: int = 1000, delay: int = 0, group: str = "", dedup: str = "", window: int = 0, priority: int = 0
) -> Sent:
    record = MessageRecord(seq, at, f"body-{seq}".encode(), {"k": str(seq)}, group, dedup)
    delivery = Delivery(seq, DeliveryState.READY, at, at + delay, priority=priority)
    return Sent(record, delivery, at + window if dedup and window else 0)


class StoreContract:
    def test_sent_message_is_readable_and_eligible(self, store: ShardStore) -> None:
        apply_event(store, sent(1), fifo=False, now_ms=1000)
        record = store.get_record(1)
        assert record is not None
        assert record.body == b"body-1"
        assert record.attributes == {"k": "1"}
        assert store.eligible(1000, after=None, limit=10) == [(1000, 1)]
        assert store.message_count() == 1
        assert store.last_seq() == 1

    def test_delayed_message_is_not_eligible_before_its_time(self, store: ShardStore) -> None:
        apply_event(store, sent(1, delay=500), fifo=False, now_ms=1000)
        assert store.eligible(1499, after=None, limit=10) == []
        assert store.eligible(1500, after=None, limit=10) == [(1500, 1)]

    def test_eligible_is_ordered_and_resumes_after_a_key(self, store: ShardStore) -> None:
        for seq, delay in ((1, 30), (2, 10), (3, 20)):
            apply_event(store, sent(seq, delay=delay), fifo=False, now_ms=1000)
        assert store.eligible(2000, after=None, limit=10) == [(1010, 2), (1020, 3), (1030, 1)]
        assert store.eligible(2000, after=(1010, 2), limit=1) == [(1020, 3)]

    def test_messages_above_lane_0_are_eligible_by_priority_highest_lane_first(self, store: ShardStore) -> None:
        for seq, delay, priority in ((1, 0, 0), (2, 30, 2), (3, 10, 1), (4, 0, 2), (5, 900, 2), (6, 20, 1)):
            apply_event(store, sent(seq, delay=delay, priority=priority), fifo=False, now_ms=1000)
        # Lane 2's message 5 waits: the scan goes on to lane 1 rather than stopping there.
        assert store.eligible_by_priority(1100, after=None, limit=10) == [
            (253, 1000, 4),
            (253, 1030, 2),
            (254, 1010, 3),
            (254, 1020, 6),
        ]
        assert store.eligible_by_priority(1100, after=(253, 1030, 2), limit=1) == [(254, 1010, 3)]
        assert store.eligible_by_priority(1015, after=None, limit=10) == [(253, 1000, 4), (254, 1010, 3)]
        # Every message is in the index as before, lane 0's among them.
        assert [seq for _, seq in store.eligible(1100, after=None, limit=10)] == [1, 4, 3, 6, 2]
        # A claim moves a message's priority key with its index key; a delete removes both.
        delivery = store.get_delivery(4)
        assert delivery is not None
        claimed = Delivery(4, DeliveryState.CLAIMED, 1000, 5000, 1, 1000, 1000, 1, 1, priority=2)
        apply_event(store, DeliveryChanged(ChangeKind.RECEIVED, claimed), fifo=False, now_ms=1000)
        assert [key[-1] for key in store.eligible_by_priority(1100, after=None, limit=10)] == [2, 3, 6]
        assert store.eligible_by_priority(5000, after=None, limit=1) == [(253, 1030, 2)]
        apply_event(store, Removed(RemovalKind.DELETED, 2, 1000), fifo=False, now_ms=1000)
        assert [key[-1] for key in store.eligible_by_priority(5000, after=None, limit=10)] == [5, 4, 3, 6]
        apply_event(store, Purged(6, 5), fifo=False, now_ms=1000)
        assert store.eligible_by_priority(5000, after=None, limit=10) == []

    def test_claim_moves_the_index_key(self, store: ShardStore) -> None:
        apply_event(store, sent(1), fifo=False, now_ms=1000)
        delivery = store.get_delivery(1)
        assert delivery is not None
        claimed = Delivery(1, DeliveryState.CLAIMED, 1000, 5000, 1, 1000, 1000, 1, 1)
        apply_event(store, DeliveryChanged(ChangeKind.RECEIVED, claimed), fifo=False, now_ms=1000)
        assert store.eligible(4999, after=None, limit=10) == []
        assert store.eligible(5000, after=None, limit=10) == [(5000, 1)]
        assert store.get_delivery(1) == claimed

    def test_a_change_recorded_in_one_step_moves_the_message_as_applying_it_does(self, store: ShardStore) -> None:
        for seq in (1, 2):
            apply_event(store, sent(seq), fifo=False, now_ms=1000)
        claimed = Delivery(1, DeliveryState.CLAIMED, 1000, 5000, 1, 1000, 1000, 1, 1)
        store.record_delivery_change(DeliveryChanged(ChangeKind.RECEIVED, claimed), previous=sent(1).delivery)
        dead = Delivery(2, DeliveryState.DEAD_LETTER_PENDING, 1000, 1000, 3)
        store.record_delivery_change(DeliveryChanged(ChangeKind.DEAD_LETTERED, dead, "max"), previous=sent(2).delivery)
        assert store.get_delivery(1) == claimed
        assert store.get_delivery(2) == dead
        assert store.eligible(4999, after=None, limit=10) == []
        assert store.eligible(5000, after=None, limit=10) == [(5000, 1)]
        assert store.dead_letter_pending(limit=10) == [2]

    def test_removed_message_is_gone_everywhere(self, store: ShardStore) -> None:
        apply_event(store, sent(1), fifo=False, now_ms=1000)
        apply_event(store, Removed(RemovalKind.DELETED, 1, 1000), fifo=False, now_ms=1001)
        assert store.get_record(1) is None
        assert store.get_delivery(1) is None
        assert store.eligible(10_000, after=None, limit=10) == []
        assert store.message_count() == 0

    def test_dead_lettered_message_leaves_the_index_for_the_outbox(self, store: ShardStore) -> None:
        apply_event(store, sent(1), fifo=False, now_ms=1000)
        dead = Delivery(1, DeliveryState.DEAD_LETTER_PENDING, 1000, 1000, 3)
        apply_event(store, DeliveryChanged(ChangeKind.DEAD_LETTERED, dead, "max"), fifo=False, now_ms=1000)
        assert store.eligible(10_000, after=None, limit=10) == []
        assert store.dead_letter_pending(limit=10) == [1]
        apply_event(store, Removed(RemovalKind.DEAD_LETTER_DELIVERED, 1, 1000), fifo=False, now_ms=1001)
        assert store.dead_letter_pending(limit=10) == []

    def test_fifo_group_only_exposes_its_head(self, store: ShardStore) -> None:
        for seq in (1, 2, 3):
            apply_event(store, sent(seq, group="g"), fifo=True, now_ms=1000)
        assert store.eligible(10_000, after=None, limit=10) == [(1000, 1)]
        assert store.first_group_member("g") == 1
        apply_event(store, Removed(RemovalKind.DELETED, 1, 1000), fifo=True, now_ms=2000)
        # The next member is promoted, visible from the removal time on.
        assert store.eligible(10_000, after=None, limit=10) == [(2000, 2)]

    def test_dedup_entries_are_pruned_by_expiry(self, store: ShardStore) -> None:
        apply_event(store, sent(1, dedup="a", window=100), fifo=False, now_ms=1000)
        apply_event(store, sent(2, at=1050, dedup="b", window=100), fifo=False, now_ms=1050)
        assert store.dedup_lookup("a") == (1, 1000, 1100)
        apply_event(store, DedupPruned(1100), fifo=False, now_ms=1100)
        assert store.dedup_lookup("a") is None
        assert store.dedup_lookup("b") == (2, 1050, 1150)

    def test_purge_clears_messages_but_keeps_dedup(self, store: ShardStore) -> None:
        apply_event(store, sent(1, dedup="a", window=100), fifo=False, now_ms=1000)
        apply_event(store, sent(2, group="g"), fifo=True, now_ms=1000)
        apply_event(store, Purged(2, 2), fifo=True, now_ms=1001)
        assert store.message_count() == 0
        assert store.eligible(10_000, after=None, limit=10) == []
        assert store.first_group_member("g") is None
        assert store.dedup_lookup("a") is not None
        assert store.last_seq() == 2

    def test_oldest_messages_come_in_seq_order(self, store: ShardStore) -> None:
        for seq in (1, 2, 3):
            apply_event(store, sent(seq, at=1000 + seq), fifo=False, now_ms=1000 + seq)
        assert store.oldest_messages(after_seq=0, limit=2) == [(1, 1001), (2, 1002)]
        assert store.oldest_messages(after_seq=2, limit=5) == [(3, 1003)]


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> ShardStore:
        return MemoryShardStore()


class TestLmdbStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: pathlib.Path) -> Iterator[ShardStore]:
        environment = ShardEnvironment(tmp_path / "shard", queue="q", shard=0, map_size=1 << 26)
        try:
            with environment.env.begin(write=True) as txn:
                from shard_server.storage.lmdb_store import LmdbShardTransaction

                yield LmdbShardTransaction(txn, environment.dbs)
        finally:
            environment.close()
