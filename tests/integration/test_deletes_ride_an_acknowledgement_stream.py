"""AsyncClient.delete_messages sends its batches on one acknowledgement-only consumer
stream per queue and leader (shardq.ack_streams), and a caller sees what a unary delete
gave it: per-receipt results, QueueNotFound for a deleted queue, deletes that carry on
across a server restart or SIGKILL, and OutcomeUnknown when no answer comes. A server
stopping ends such streams at once, after answering what it read, instead of waiting
out its grace period for them; consumer streams granted credits keep theirs."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from shardq import AsyncClient, Message, ack_streams
from shardq.errors import OutcomeUnknown, QueueNotFound, Reason, ShardqError
from shardq.types import ReceivedMessage
from tests.integration.scraping import scraped_total
from tests.support.servers import ServerFactory, wait_for

QUEUE = "work"
CONSUME = "QueueService/ConsumeStream"
DELETES = "QueueService/DeleteMessages"


async def received(client: AsyncClient, queue: str, count: int) -> list[ReceivedMessage]:
    messages: list[ReceivedMessage] = []
    while len(messages) < count:
        messages += await client.receive_messages(queue, max_messages=10, visibility_timeout_ms=60_000)
    return messages


def test_a_clients_deletes_share_one_stream_that_closes_with_the_client(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")

    async def scenario() -> tuple[list[bool], float, float, float]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(12)])
            messages = await received(client, QUEUE, 12)
            unary_before = scraped_total(server.metrics_url, "shardq_requests_total", method=DELETES)
            oks = []
            for message in messages[:6]:  # one at a time
                (result,) = await client.delete_messages(QUEUE, [message.receipt])
                oks.append(result.ok)
            results = await asyncio.gather(*(client.delete_messages(QUEUE, [m.receipt]) for m in messages[6:]))
            oks += [result.ok for (result,) in results]
            open_streams = scraped_total(server.metrics_url, "shardq_open_streams", method=CONSUME)
            unary = scraped_total(server.metrics_url, "shardq_requests_total", method=DELETES) - unary_before
            left = (await client.attributes(QUEUE)).in_flight
        return oks, open_streams, unary, left

    oks, open_streams, unary, left = asyncio.run(scenario())
    assert oks == [True] * 12
    assert left == 0
    assert unary == 0, f"{unary:.0f} deletes went out as unary calls"
    assert open_streams == 1, f"{open_streams:.0f} consume streams open for one client's deletes"
    wait_for(
        lambda: scraped_total(server.metrics_url, "shardq_open_streams", method=CONSUME) == 0 or None,
        timeout=5,
        what="the acknowledgement stream to close with its client",
    )


def test_a_delete_on_a_queue_deleted_since_raises_queue_not_found_and_a_new_queue_of_that_name_is_served(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(f"{QUEUE}:shards=1")

    async def scenario() -> tuple[list[bool], ShardqError | None, list[bool]]:
        async with AsyncClient(server.endpoint) as client:
            await client.create_queue("temp")
            await client.send_messages("temp", [Message(b"a"), Message(b"b")])
            first, second = await received(client, "temp", 2)
            before = [result.ok for result in await client.delete_messages("temp", [first.receipt])]
            await client.delete_queue("temp")
            refused: ShardqError | None = None
            try:
                await client.delete_messages("temp", [second.receipt])
            except ShardqError as error:
                refused = error
            await client.create_queue("temp")
            await client.send_messages("temp", [Message(b"c")])
            (third,) = await received(client, "temp", 1)
            after = [result.ok for result in await client.delete_messages("temp", [third.receipt])]
        return before, refused, after

    before, refused, after = asyncio.run(scenario())
    assert before == [True]
    assert isinstance(refused, QueueNotFound), repr(refused)
    assert after == [True]


def test_a_stopping_server_ends_acknowledgement_streams_at_once_and_keeps_consumer_streams(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(f"{QUEUE}:shards=1")

    async def scenario() -> tuple[ShardqError | None, float, bool]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m")])
            (message,) = await received(client, QUEUE, 1)
            async with (
                client.consume(QUEUE, credits=0) as acknowledging,
                client.consume(QUEUE, credits=10) as consuming,
            ):
                # On this stream itself (a stream's delete() is its client's, on another).
                answer = await acknowledging.acknowledge_deletes([message.receipt])
                assert [result.ok for result in answer.deleted] == [True]
                stopped_at = time.monotonic()
                os.kill(server.pid, signal.SIGTERM)
                ended: ShardqError | None = None
                try:
                    async for _ in acknowledging.messages():
                        pass
                except ShardqError as error:
                    ended = error
                took = time.monotonic() - stopped_at
                # The server is still in its grace period: the consumer stream is open.
                consumer_open = not consuming.ended
        return ended, took, consumer_open

    ended, took, consumer_open = asyncio.run(scenario())
    assert ended is not None
    assert ended.reason is Reason.SHUTTING_DOWN, repr(ended)
    # The grace period is 5 s (shard_server.server.SHUTDOWN_GRACE_S): ended before it ran out.
    assert took < 4, f"the acknowledgement stream ended {took:.1f} s after SIGTERM"
    assert consumer_open, "a consumer stream granted credits was ended with the acknowledgement streams"
    assert server.process is not None
    server.process.wait(timeout=30)


def test_deletes_carry_on_after_the_server_restarts_or_is_killed(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=1")

    async def scenario() -> list[bool]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(3)])
            messages = await received(client, QUEUE, 3)
            oks = [result.ok for result in await client.delete_messages(QUEUE, [messages[0].receipt])]
            await asyncio.to_thread(server.restart)  # SIGTERM: the server ends the stream
            oks += [result.ok for result in await client.delete_messages(QUEUE, [messages[1].receipt])]
            streams = list(client._ack_streams._pool._streams.values())
            await asyncio.to_thread(server.kill)  # the stream breaks; nothing answers now
            # Once the client has seen it break. A delete put on the stream before that
            # rides a connection that is already gone, and the client cannot tell it from
            # one cut off mid-call: OUTCOME_UNKNOWN, by design (the unary case is
            # test_a_delete_cut_off_mid_call_is_outcome_unknown). Found by a CI run in which
            # the third delete went out before the client had read the socket's close.
            deadline = time.monotonic() + 10
            while not all(stream.ended for stream in streams) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert streams, "the deletes before the kill rode no acknowledgement stream"
            assert all(stream.ended for stream in streams), "the client never saw the stream break"
            # Back before the unary path's wait for a restarting server runs out.
            restart = threading.Timer(0.5, server.start)
            restart.start()
            try:
                oks += [result.ok for result in await client.delete_messages(QUEUE, [messages[2].receipt])]
            finally:
                restart.join()
            return oks

    assert asyncio.run(scenario()) == [True, True, True]


def test_a_delete_the_server_never_answers_raises_outcome_unknown(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory(f"{QUEUE}:shards=1")
    monkeypatch.setattr(ack_streams, "ANSWER_TIMEOUT_S", 1.0)

    async def scenario() -> tuple[ShardqError | None, int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"a"), Message(b"b")])
            first, second = await received(client, QUEUE, 2)
            await client.delete_messages(QUEUE, [first.receipt])  # the stream is open
            os.kill(server.pid, signal.SIGSTOP)  # a server that takes the delete and never answers
            unanswered: ShardqError | None = None
            try:
                # Bounded here, so that a client waiting forever fails the test instead of hanging it.
                await asyncio.wait_for(client.delete_messages(QUEUE, [second.receipt]), 10)
            except ShardqError as error:
                unanswered = error
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # The stuck stream was dropped and the delete goes out again on a new one. The
            # server may have applied the first one once it ran again (it had the frame):
            # then this one answers MESSAGE_NOT_FOUND, which is why the caller was told
            # "unknown" rather than "not deleted". Either way the message is gone.
            again = await client.delete_messages(QUEUE, [second.receipt])
            attributes = await client.attributes(QUEUE)
        return unanswered, len(again), attributes.visible + attributes.in_flight

    unanswered, answered, left = asyncio.run(scenario())
    assert isinstance(unanswered, OutcomeUnknown), repr(unanswered)
    assert answered == 1
    assert left == 0
