"""A consumer stream's `delete()` is its client's `delete_messages`: the deletes of several
streams of one client share acknowledgement requests, and so commits, where each stream
sent its own; and a receipt taken from a stream stays good for a delete after that stream
ended, as receipts are not tied to a connection."""

from __future__ import annotations

import asyncio

from shard_server.storage.commit_ahead import SLOT_SIZE
from shardq import AsyncClient, Message
from shardq.ack_streams import MAX_ACK_BATCH
from shardq.types import ReceivedMessage
from tests.integration.scraping import scraped_total
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "work"
CONSUME = "QueueService/ConsumeStream"
STREAMS = 4


async def received(client: AsyncClient, count: int) -> list[ReceivedMessage]:
    messages: list[ReceivedMessage] = []
    while len(messages) < count:
        messages += await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
    return messages


async def commits_counted_so_far(client: AsyncClient, server: ServerProcess) -> float:
    """The commits of the queue's one shard, once every commit made so far is counted.

    Receives are answered before their claims commit, and small sends and deletes once
    written ahead, before theirs: each commit is counted a moment after its answer. A send
    too large for the commit-ahead file is answered only once committed and counted, and
    the shard's one writer commits it after every batch before it: once it is answered,
    they are all counted too."""
    body = b"x" * (SLOT_SIZE // 2)
    await client.send_messages(QUEUE, [Message(body), Message(body)])
    return scraped_total(server.metrics_url, "shardq_commits_total", queue=QUEUE)


def test_four_streams_deletes_share_requests(server_factory: ServerFactory) -> None:
    """Four streams each delete one message, all at once: the first delete goes out alone,
    the three made while it is in flight go together once it is answered. Sent by each
    stream on itself, they were four acknowledgements."""
    server = server_factory(f"{QUEUE}:shards=1")

    async def scenario() -> tuple[list[bool], float, float, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(STREAMS)])
            messages = await received(client, STREAMS)
            # Granted no credits, the streams only carry what is sent on them.
            streams = [client.consume(QUEUE, credits=0) for _ in range(STREAMS)]
            for stream in streams:
                await stream.__aenter__()
            try:
                acknowledged = scraped_total(server.metrics_url, "shardq_stream_requests_total", method=CONSUME)
                # Counted once the receives' claims are: a claim counted late was taken for
                # a delete's commit (CI, 352ffd1).
                commits = await commits_counted_so_far(client, server)
                results = await asyncio.gather(
                    *(stream.delete([message.receipt]) for stream, message in zip(streams, messages, strict=True))
                )
                acknowledged = (
                    scraped_total(server.metrics_url, "shardq_stream_requests_total", method=CONSUME) - acknowledged
                )
                # Less the counting send's own commit.
                commits = await commits_counted_so_far(client, server) - commits - 1
            finally:
                for stream in streams:
                    await stream.close()
            left = (await client.attributes(QUEUE)).in_flight
        return [result.ok for (result,) in results], acknowledged, commits, left

    oks, acknowledged, commits, left = asyncio.run(scenario())
    assert oks == [True] * STREAMS
    assert left == 0
    assert acknowledged == 2, f"four streams' deletes took {acknowledged:.0f} acknowledgement requests, not 2"
    assert commits == 2, f"four streams' deletes took {commits:.0f} commits, not 2"


def test_a_receipt_from_a_stream_that_ended_still_deletes_its_message(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=1")

    async def scenario() -> tuple[bool, int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"kept until deleted")])
            async with client.consume(QUEUE, credits=1, visibility_timeout_ms=60_000) as stream:
                message = await anext(aiter(stream.messages()))
            assert stream.ended
            (result,) = await asyncio.wait_for(stream.delete([message.receipt]), timeout=10)
            attributes = await client.attributes(QUEUE)
        return result.ok, attributes.in_flight, attributes.visible

    ok, in_flight, visible = asyncio.run(scenario())
    assert ok
    assert (in_flight, visible) == (0, 0), "the deleted message is still in the queue"


def test_a_stream_deletes_any_number_of_receipts_at_once(server_factory: ServerFactory) -> None:
    """More receipts than one request holds go in several, as the stream's own deletes did;
    none is a no-op (a request of none is refused)."""
    server = server_factory(f"{QUEUE}:shards=2")
    count = MAX_ACK_BATCH + 5

    async def scenario() -> tuple[list[bool], list[object], int]:
        async with AsyncClient(server.endpoint) as client:
            for start in range(0, count, 100):
                await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(start, min(count, start + 100))])
            messages: list[ReceivedMessage] = []
            while len(messages) < count:
                messages += await client.receive_messages(QUEUE, max_messages=1000, visibility_timeout_ms=60_000)
            async with client.consume(QUEUE, credits=0) as stream:
                nothing = await stream.delete([])
                results = await stream.delete([message.receipt for message in messages])
            attributes = await client.attributes(QUEUE)
        return [result.ok for result in results], list(nothing), attributes.visible + attributes.in_flight

    oks, nothing, left = asyncio.run(scenario())
    assert oks == [True] * count
    assert nothing == []
    assert left == 0
