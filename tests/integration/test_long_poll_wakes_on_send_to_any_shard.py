"""A long-polling receiver on a sharded queue wakes when any shard gets a message."""

from __future__ import annotations

import asyncio
import time

from shardq import AsyncClient, Message
from tests.support.servers import ServerProcess

QUEUE = "orders"  # four shards
WAIT_MS = 10_000


async def one_round(client: AsyncClient) -> tuple[int, float, bool]:
    started = time.monotonic()
    receiver = asyncio.create_task(client.receive_messages(QUEUE, max_messages=1, wait_time_ms=WAIT_MS))
    await asyncio.sleep(0.2)  # let the receive reach the server and start waiting
    assert not receiver.done()
    (sent,) = await client.send_messages(QUEUE, [Message(b"wake up")])
    (received,) = await asyncio.wait_for(receiver, timeout=WAIT_MS / 1000 + 5)
    elapsed = time.monotonic() - started
    await client.delete_messages(QUEUE, [received.receipt])
    return sent.shard, elapsed, received.message_id == sent.message_id


async def scenario(endpoint: str) -> dict[int, float]:
    async with AsyncClient(endpoint) as client:
        slowest: dict[int, float] = {}
        for _ in range(12):
            shard, elapsed, same = await one_round(client)
            assert same
            slowest[shard] = max(slowest.get(shard, 0.0), elapsed)
            if len(slowest) == 4:
                break
        return slowest


def test_long_poll_wakes_for_a_send_to_any_shard(server: ServerProcess) -> None:
    slowest = asyncio.run(scenario(server.endpoint))
    assert sorted(slowest) == [0, 1, 2, 3]
    for shard, elapsed in slowest.items():
        assert elapsed < 2.0, f"a send to shard {shard} woke the receiver only after {elapsed:.2f}s"
