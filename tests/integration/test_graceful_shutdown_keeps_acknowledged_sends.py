"""SIGTERM while sends are in flight: a clean exit, and every acknowledged send is there after restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from shardq import AsyncClient, Client, Message, ShardqError
from tests.support.servers import ServerProcess, drain

QUEUE = "orders"
PRODUCERS = 6
BATCH = 20
STOP_AFTER_ACKED = 600
RUN_DEADLINE_S = 30.0


async def produce(client: AsyncClient, acked: set[str], producer: int) -> None:
    """Send until the server refuses (it is shutting down or gone)."""
    n = 0
    while True:
        n += 1
        batch = [Message(f"p{producer}-{n}-{i}".encode()) for i in range(BATCH)]
        try:
            results = await client.send_messages(QUEUE, batch)
        except ShardqError:
            return
        acked.update(r.message_id for r in results if r.ok)


async def run_until_terminated(server: ServerProcess, acked: set[str]) -> int:
    async with AsyncClient(server.endpoint) as client:
        producers = [asyncio.create_task(produce(client, acked, p)) for p in range(PRODUCERS)]
        deadline = time.monotonic() + RUN_DEADLINE_S
        while len(acked) < STOP_AFTER_ACKED and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(acked) >= STOP_AFTER_ACKED
        exit_code = await asyncio.to_thread(server.stop)
        await asyncio.wait_for(asyncio.gather(*producers), timeout=RUN_DEADLINE_S)
        return exit_code


@pytest.mark.slow
def test_sigterm_under_load_keeps_every_acknowledged_send(server: ServerProcess) -> None:
    acked: set[str] = set()
    exit_code = asyncio.run(run_until_terminated(server, acked))
    assert exit_code == 0, server.log()[-2000:]
    assert "stopped" in server.log()

    server.restart()
    with Client(server.endpoint) as client:
        present = {m.message_id for m in drain(client, QUEUE)}
    missing = acked - present
    assert not missing, f"{len(missing)} acknowledged sends missing after SIGTERM, e.g. {sorted(missing)[:5]}"
