"""Replaying a shard's log on an empty store rebuilds exactly the leader's state:
the property followers and the Spark journal rely on."""

from __future__ import annotations

import pathlib
import random

from shard_server.domain import acknowledging, housekeeping, receiving, sending
from shard_server.domain.applying import apply_event
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.storage.lmdb_store import LmdbShardTransaction, ShardEnvironment
from shard_server.storage.memory import MemoryShardStore
from shardq.queues import QueueConfig

CONFIG = QueueConfig(
    name="orders",
    fifo=True,
    visibility_timeout_ms=50,
    dedup_window_ms=100,
    dead_letter_queue="dlq",
    max_receive_count=2,
    retention_ms=5_000,
)


def test_log_replay_rebuilds_the_same_state(tmp_path: pathlib.Path) -> None:
    environment = ShardEnvironment(tmp_path / "shard", queue="orders", shard=0, map_size=1 << 26)
    context = ShardContext(CONFIG, shard=0, epoch=7)
    rng = random.Random(42)
    receipts = []
    now = 1_000
    for _ in range(300):
        now += rng.choice([0, 5, 30, 80])
        choice = rng.random()

        def step(tx: LmdbShardTransaction, choice: float = choice, at: int = now) -> None:
            if choice < 0.4:
                batch = [
                    NewMessage(
                        rng.randbytes(8),
                        {"n": str(rng.randint(0, 9))},
                        rng.choice("abc"),
                        rng.choice(["", "", "d1", "d2"]),
                        rng.choice([0, 20]),
                    )
                    for _ in range(rng.randint(1, 3))
                ]
                sending.send_messages(tx, context, batch, now_ms=at)
            elif choice < 0.7:
                outcome = receiving.receive_messages(tx, context, max_messages=3, visibility_timeout_ms=40, now_ms=at)
                receipts.extend(c.receipt for c in outcome.claimed)
            elif choice < 0.85 and receipts:
                acknowledging.delete_message(tx, context, rng.choice(receipts), now_ms=at)
            elif choice < 0.9 and receipts:
                acknowledging.release_message(tx, context, rng.choice(receipts), now_ms=at)
            elif choice < 0.95:
                housekeeping.prune_dedup(tx, context, now_ms=at)
            else:
                housekeeping.complete_dead_letters(tx, context, tx.dead_letter_pending(limit=2), now_ms=at)

        environment.write(step, epoch=context.epoch, at_ms=now)

    replica = MemoryShardStore()
    with environment.read() as tx:
        entries = list(tx.iter_log(from_index=1, to_index=tx.last_index() + 1))
        assert [e.index for e in entries] == list(range(1, len(entries) + 1))
        assert all(e.epoch == 7 for e in entries)
        for entry in entries:
            for event in entry.events:
                apply_event(replica, event, fifo=True, now_ms=entry.at_ms)
        leader_records = {record.seq: record for record, _ in tx.iter_messages()}
        leader_deliveries = {delivery.seq: delivery for _, delivery in tx.iter_messages()}
        assert replica.records == leader_records
        assert replica.deliveries == leader_deliveries
        assert replica.eligible(10**12, after=None, limit=10_000) == tx.eligible(10**12, after=None, limit=10_000)
        assert replica.dead_letter_pending(limit=10_000) == tx.dead_letter_pending(limit=10_000)
        assert replica.last_seq() == tx.last_seq()
    environment.close()
