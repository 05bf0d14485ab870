"""Invariant 3: SIGKILL mid-run loses no acknowledged send and resurrects no acknowledged delete."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from shardq import AsyncClient, Client, Message, ShardqError
from tests.support.servers import ServerProcess, drain, stored_count, wait_for

QUEUE = "orders"
DLQ = "orders-dlq"
TOTAL = 2_000
BATCH = 10
PRODUCERS = 4
CONSUMERS = 3
# Kill the server three times, each time once this many more sends were acknowledged.
KILLS = 3
KILL_EVERY_ACKED = 500
RUN_DEADLINE_S = 30.0
# Short enough that in-flight messages come back soon after the restart.
VISIBILITY_MS = 1_500


@dataclasses.dataclass
class Ledger:
    acked_sends: set[str] = dataclasses.field(default_factory=set)
    received: set[str] = dataclasses.field(default_factory=set)
    acked_deletes: set[str] = dataclasses.field(default_factory=set)
    delete_attempted: set[str] = dataclasses.field(default_factory=set)
    attempted: int = 0
    stop: bool = False


async def produce(client: AsyncClient, ledger: Ledger, producer: int) -> None:
    while not ledger.stop and ledger.attempted < TOTAL:
        ledger.attempted += BATCH
        batch = [Message(f"p{producer}-{ledger.attempted}-{i}".encode()) for i in range(BATCH)]
        try:
            results = await client.send_messages(QUEUE, batch)
        except ShardqError:
            return  # the server is gone: nothing of this batch was acknowledged
        ledger.acked_sends.update(r.message_id for r in results if r.ok)


async def consume(client: AsyncClient, ledger: Ledger) -> None:
    while not ledger.stop:
        try:
            batch = await client.receive_messages(
                QUEUE, max_messages=20, visibility_timeout_ms=VISIBILITY_MS, wait_time_ms=200
            )
            ledger.received.update(m.message_id for m in batch)
            # Leave every third message undeleted: it must come back after the restart.
            to_delete = [m for i, m in enumerate(batch) if i % 3]
            if not to_delete:
                continue
            ledger.delete_attempted.update(m.message_id for m in to_delete)
            results = await client.delete_messages(QUEUE, [m.receipt for m in to_delete])
        except ShardqError:
            return
        ledger.acked_deletes.update(m.message_id for m, r in zip(to_delete, results, strict=True) if r.ok)


async def run_until_killed(server: ServerProcess, ledger: Ledger, kill_at_acked: int) -> None:
    ledger.stop = False
    deletes_before = len(ledger.acked_deletes)
    async with AsyncClient(server.endpoint) as client:
        workers = [asyncio.create_task(produce(client, ledger, p)) for p in range(PRODUCERS)]
        workers += [asyncio.create_task(consume(client, ledger)) for _ in range(CONSUMERS)]
        deadline = time.monotonic() + RUN_DEADLINE_S
        while len(ledger.acked_sends) < kill_at_acked and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert len(ledger.acked_sends) >= kill_at_acked, "producers too slow to reach the kill point"
        assert len(ledger.acked_deletes) > deletes_before, "consumers deleted nothing before the kill"
        await asyncio.to_thread(server.kill)
        await asyncio.wait_for(asyncio.gather(*workers), timeout=RUN_DEADLINE_S)
        ledger.stop = True


@pytest.mark.slow
def test_acknowledged_sends_survive_sigkill(server: ServerProcess) -> None:
    ledger = Ledger()
    for kill in range(1, KILLS + 1):
        asyncio.run(run_until_killed(server, ledger, kill * KILL_EVERY_ACKED))
        assert not server.alive()
        server.restart()
    after: set[str] = set()
    with Client(server.endpoint) as client:

        def drained_everything() -> bool:
            # Messages received twice (before and after a kill) may be dead-lettered: they count too.
            after.update(m.message_id for m in drain(client, QUEUE))
            # A dead-letter copy names its original in its dedup id.
            after.update(m.dedup_id.removeprefix("dlq:") for m in drain(client, DLQ))
            return stored_count(client, QUEUE) == 0 and stored_count(client, DLQ) == 0

        wait_for(drained_everything, timeout=30, interval=0.2, what="every message to be drained")

    lost = ledger.acked_sends - after - ledger.received
    assert not lost, f"{len(lost)} acknowledged sends lost, e.g. {sorted(lost)[:5]}"
    resurrected = ledger.acked_deletes & after
    assert not resurrected, f"{len(resurrected)} acknowledged deletes came back, e.g. {sorted(resurrected)[:5]}"
    # Received and never deleted: back after the visibility timeout, not lost with the claim.
    kept = ledger.received - ledger.delete_attempted
    assert kept, "no message was left undeleted"
    assert kept <= after, f"{len(kept - after)} received, undeleted messages did not come back"
