"""Concurrent receives claim from a shard whose next batch is still taking requests, so
they share its transaction and fsync (and their deletes later share commits too).
Unkeyed sends rotate over every shard one by one; a few concurrent ones share one
shard's open batch (one fsync, not one per shard), and many spread over every shard
again, so the writer's fsyncs and the event loop's work overlap."""

from __future__ import annotations

import asyncio
import pathlib

from shard_server.domain.messages import NewMessage
from shard_server.runtime.committing import WriterThreads
from shard_server.runtime.hosting import JOIN_OPEN_BATCHES_UP_TO_CALLS, HostedQueue
from shardq.queues import QueueConfig

CONFIG = QueueConfig(name="orders", shards=4)


def message(number: int) -> NewMessage:
    return NewMessage(b"m%d" % number, {}, "", "", 0)


def hosted_queue(directory: pathlib.Path, writers: WriterThreads) -> HostedQueue:
    return HostedQueue(CONFIG, directory, map_size=1 << 26, writers=writers)


def test_unkeyed_sends_rotate_one_by_one_and_few_concurrent_ones_share_a_batch(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        queue = hosted_queue(tmp_path / "queue", writers)
        try:
            one_by_one = [(await queue.send([message(number)]))[0].shard for number in range(4)]
            assert set(one_by_one) == set(range(CONFIG.shards))
            few = await asyncio.gather(*(queue.send([message(number)]) for number in range(4, 8)))
            assert len({outcomes[0].shard for outcomes in few}) == 1
            many = JOIN_OPEN_BATCHES_UP_TO_CALLS + 2 * CONFIG.shards
            spread = await asyncio.gather(*(queue.send([message(number)]) for number in range(8, 8 + many)))
            assert {outcomes[0].shard for outcomes in spread} == set(range(CONFIG.shards))
        finally:
            await queue.close()
            writers.shutdown()

    asyncio.run(scenario())


def test_concurrent_receives_claim_from_one_shard(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        queue = hosted_queue(tmp_path / "queue", writers)
        try:
            for number in range(4 * CONFIG.shards):  # four messages on every shard
                await queue.send([message(number)], shard=number % CONFIG.shards)
            received = await asyncio.gather(
                *(queue.receive(max_messages=1, visibility_timeout_ms=30_000, wait_ms=0) for _ in range(4))
            )
            shards = {hosted.index for answer in received for hosted, _ in answer.local}
            assert sum(len(answer) for answer in received) == 4
            assert len(shards) == 1
        finally:
            await queue.close()
            writers.shutdown()

    asyncio.run(scenario())
