"""Streaming fast paths: batched concurrent sends, consumer streams bounded by credits, release with backoff."""

from __future__ import annotations

import asyncio
import time

from shardq import AsyncClient, Client, EntryResult, Message
from shardq.errors import InvalidArgument
from tests.support.servers import ServerFactory, ServerProcess, stored_count, wait_for

QUEUE = "stream"
SPEC = f"{QUEUE}:shards=3,nack_backoff_base=500ms,nack_backoff_max=2s"
SENDS = 1_500


async def send_concurrently(endpoint: str) -> list[str]:
    async with AsyncClient(endpoint) as client:
        results = await asyncio.gather(*(client.send(QUEUE, b"%d" % i) for i in range(SENDS)))
        return [r.message_id for r in results]


async def consume_and_delete(endpoint: str, expected: int) -> list[bytes]:
    bodies: list[bytes] = []
    async with AsyncClient(endpoint) as client, client.consume(QUEUE, credits=50, max_batch=25) as stream:
        pending: list[str] = []
        async for message in stream.messages():
            bodies.append(message.body)
            pending.append(message.receipt)
            if len(pending) == 100 or len(bodies) == expected:
                results = await stream.delete(pending)
                assert all(r.ok for r in results), results[:3]
                pending = []
            if len(bodies) == expected:
                break
    return bodies


def test_concurrent_sends_are_batched_and_consumed_over_a_stream(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)
    ids = asyncio.run(send_concurrently(server.endpoint))
    assert len(ids) == SENDS
    assert all(ids)
    assert len(set(ids)) == SENDS
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == SENDS
        bodies = asyncio.run(asyncio.wait_for(consume_and_delete(server.endpoint, SENDS), timeout=60))
        assert sorted(bodies) == sorted(b"%d" % i for i in range(SENDS))
        wait_for(lambda: stored_count(client, QUEUE) == 0, timeout=5, what="deletes to be applied")


def test_one_callers_invalid_message_fails_only_that_callers_stream_send(server_factory: ServerFactory) -> None:
    """Concurrent send() calls share a stream request, which the server refuses whole for
    one invalid message: the other callers' sends failed with that caller's error (and
    were not stored). Now the refused request goes again call by call."""
    server = server_factory(SPEC)

    async def scenario() -> tuple[list[object], list[bytes]]:
        async with AsyncClient(server.endpoint) as client:
            # Opens the stream: below, the first call goes alone and the rest share a request.
            await client.send(QUEUE, b"warm-up")
            outcomes = await asyncio.gather(
                *(client.send(QUEUE, b"ok%d" % n) for n in range(5)),
                # Attribute keys under "shardq." are the server's.
                client.send(QUEUE, b"bad", attributes={"shardq.reason": "x"}),
                return_exceptions=True,
            )
            received: list[bytes] = []
            for _ in range(20):
                if len(received) >= 6:
                    break
                received += [m.body for m in await client.receive_messages(QUEUE, max_messages=10)]
            return list(outcomes), sorted(received)

    outcomes, received = asyncio.run(scenario())
    *good, bad = outcomes
    assert all(getattr(result, "ok", False) for result in good), good
    assert isinstance(bad, InvalidArgument), repr(bad)
    assert bad.field == "messages[0].attributes", bad.field
    assert received == sorted([b"warm-up"] + [b"ok%d" % n for n in range(5)])


def test_consumer_stream_holds_no_more_than_its_credits(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)
    credits = 7

    async def hold_without_reading() -> tuple[int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"%d" % i) for i in range(30)])
            async with client.consume(QUEUE, credits=credits, visibility_timeout_ms=60_000):
                # Until we read, the server may push at most `credits` messages.
                await asyncio.to_thread(
                    wait_for, lambda: _in_flight(server) >= credits, timeout=5, what="credited messages"
                )
                await asyncio.sleep(1.5)  # longer than one server poll: nothing beyond the credits arrives
                return _in_flight(server), (await client.attributes(QUEUE)).visible

    in_flight, visible = asyncio.run(hold_without_reading())
    assert (in_flight, visible) == (credits, 30 - credits)


def test_consumer_stream_gives_credits_back_in_halves(server_factory: ServerFactory) -> None:
    """Credits go back once half of them were taken: until then the server holds no more
    than the first grant; the half-th message taken grants half again, and no more."""
    server = server_factory(SPEC)
    credits = 8

    async def take_up_to_half() -> tuple[int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"%d" % i) for i in range(30)])
            async with client.consume(QUEUE, credits=credits, visibility_timeout_ms=60_000) as stream:
                await asyncio.to_thread(
                    wait_for, lambda: _in_flight(server) >= credits, timeout=5, what="credited messages"
                )
                messages = stream.messages()
                for _ in range(credits // 2 - 1):
                    await anext(messages)
                await asyncio.sleep(1.5)  # longer than one server poll: a grant would have been claimed
                before_half = _in_flight(server)
                await anext(messages)  # the half-th
                await asyncio.to_thread(
                    wait_for,
                    lambda: _in_flight(server) >= credits + credits // 2,
                    timeout=5,
                    what="the half granted back",
                )
                await asyncio.sleep(1.5)
                after_half = _in_flight(server)
                await messages.aclose()
                return before_half, after_half

    assert asyncio.run(take_up_to_half()) == (credits, credits + credits // 2)


def test_release_over_the_stream_redelivers_after_backoff(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)

    async def release_and_wait() -> tuple[float, int]:
        async with AsyncClient(server.endpoint) as client:
            (sent,) = await client.send_messages(QUEUE, [Message(b"0")])
            async with client.consume(QUEUE, credits=1, visibility_timeout_ms=60_000) as stream:
                messages = stream.messages()
                first = await anext(messages)
                assert first.message_id == sent.message_id
                (released,) = await stream.release([first.receipt])
                assert released.ok
                released_at = time.monotonic()
                again = await asyncio.wait_for(anext(messages), timeout=10)
                assert again.message_id == sent.message_id
                (deleted,) = await stream.delete([again.receipt])
                assert deleted.ok
                return time.monotonic() - released_at, again.receive_count

    waited, receive_count = asyncio.run(release_and_wait())
    assert receive_count == 2
    # Backoff base is 500 ms: not redelivered at once (loose bound).
    assert waited >= 0.35, f"redelivered {waited:.3f}s after release"


def _in_flight(server: ServerProcess) -> int:
    with Client(server.endpoint) as client:
        return client.attributes(QUEUE).in_flight


def test_an_acknowledgement_that_fails_whole_is_still_answered(server: ServerProcess) -> None:
    """An ack the server cannot apply at all (here a release reason over the limit; in a
    cluster, leadership lost mid-way) is answered per receipt, never left unanswered:
    a consumer waiting for it used to stall for good."""

    async def scenario() -> list[EntryResult]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages("orders-dlq", [Message(b"to release")])
            async with client.consume("orders-dlq", credits=1) as stream:
                message = await anext(aiter(stream.messages()))
                return await asyncio.wait_for(stream.release([message.receipt], reason="x" * 2_000), timeout=10)

    (outcome,) = asyncio.run(scenario())
    assert not outcome.ok
    assert outcome.reason == "INVALID_ARGUMENT"
    assert "at most 1024 characters" in outcome.message
    assert server.alive()


def test_closing_a_consumer_stream_after_its_client_closed_returns_what_it_held(server: ServerProcess) -> None:
    """Closing the client's channel cancels the stream's call under it (grpc.aio then
    raises CancelledError from the call's reads): closing the stream afterwards returns
    the messages it received and never handed out, and does not raise the reader's
    cancellation into the caller (a CI run saw run_consumer fail with it)."""

    async def scenario() -> list[bytes]:
        client = AsyncClient(server.endpoint)
        await client.send_messages("orders-dlq", [Message(b"held by the stream")])
        stream = client.consume("orders-dlq", credits=1, visibility_timeout_ms=60_000)
        await stream.__aenter__()
        await asyncio.to_thread(wait_for, lambda: bool(stream.waiting()), timeout=5, what="a message received")
        await client.close()
        untaken = await asyncio.wait_for(stream.close(), timeout=10)
        return [message.body for message in untaken]

    assert asyncio.run(scenario()) == [b"held by the stream"]
    assert server.alive()
