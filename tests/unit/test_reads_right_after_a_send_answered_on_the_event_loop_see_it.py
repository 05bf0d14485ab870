"""On the event loop, a lone send is answered once its entry is written ahead, and LMDB
commits it a few loop turns later (GroupCommitter.LOOP_TURNS_BEFORE_COMMIT). A read the
caller makes at once, in those turns, must see the send all the same: a short-poll
receive claims it, a peek shows it, and the queue's counts (which the service reads
after `until_committed`) include it.

Nothing is injected: a real QueueHost, its shard environment and committer, the read
made in the same task that was answered, before the loop turns that commit run. A read
that did not wait would be answered from a read transaction begun before LMDB's commit.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Awaitable, Callable

import pytest

from shard_server.domain.messages import NewMessage
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.queue_hosts import QueueHost
from shardq.queues import QueueConfig

ROUNDS = 20


def message(body: bytes) -> NewMessage:
    return NewMessage(body=body, attributes={}, group_id="", dedup_id="", delay_ms=0)


async def receive(queue: HostedQueue) -> list[bytes]:
    received = await queue.receive(max_messages=10, visibility_timeout_ms=60_000, wait_ms=0)
    return [claimed.record.body for _, claimed in received.local]


async def peek(queue: HostedQueue) -> list[bytes]:
    peeked = await queue.peek(max_messages=100, shard=None, forwarded=False)
    return [record.body for _, record, _ in peeked.local]


async def count(queue: HostedQueue) -> list[bytes]:
    await queue.until_committed()  # as GetQueueAttributes does before counting
    (stats,) = [stats for _, stats in queue.stats()]
    return [b"%d" % stats.visible]


@pytest.mark.parametrize(
    ("read", "expected"),
    [
        (receive, lambda body, _: [body]),
        (peek, lambda _, sent: sent),
        (count, lambda _, sent: [b"%d" % len(sent)]),
    ],
    ids=["short-poll", "peek", "counts"],
)
def test_a_read_made_as_soon_as_a_send_is_answered_sees_it(
    tmp_path: pathlib.Path,
    read: Callable[[HostedQueue], Awaitable[list[bytes]]],
    expected: Callable[[bytes, list[bytes]], list[bytes]],
) -> None:
    async def scenario() -> list[tuple[list[bytes], list[bytes]]]:
        host = QueueHost(tmp_path, [QueueConfig(name="orders", shards=1)])
        queue = host.get("orders")
        sent: list[bytes] = []
        seen = []
        try:
            for round_ in range(ROUNDS):
                body = b"message %d" % round_
                await queue.send([message(body)])
                sent.append(body)
                seen.append((await read(queue), expected(body, list(sent))))
            written_ahead = queue.shards[0].environment.committed_ahead()
            assert written_ahead, "the sends were not written ahead: this test would prove nothing"
        finally:
            await host.close()
        return seen

    for got, wanted in asyncio.run(scenario()):
        assert got == wanted
