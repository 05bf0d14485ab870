"""run_consumer's workers on a real server: at most `concurrency` handlers at once, each
message handled once, `max_messages` honoured with the prefetch given back, claims kept
hidden while handlers run and while prefetched messages wait for a worker, and a broken
stream raised once the running handlers finish."""

from __future__ import annotations

import asyncio
import time

import pytest

from shardq import AsyncClient, Message, ShardqError, run_consumer
from shardq.consumer import ConsumerStats
from shardq.types import ReceivedMessage
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "work"
SPEC = f"{QUEUE}:shards=2"


async def send(client: AsyncClient, count: int) -> None:
    await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(count)])


def test_handlers_run_at_most_concurrency_at_once_and_each_message_once(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)
    seen: list[bytes] = []
    running = [0]
    most = [0]

    async def handler(message: ReceivedMessage) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.02)
        seen.append(message.body)
        running[0] -= 1

    async def scenario() -> tuple[ConsumerStats, int]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, 40)
            stats = await asyncio.wait_for(
                run_consumer(client, QUEUE, handler, concurrency=4, handle_signals=False, max_messages=40), 60
            )
            attributes = await client.attributes(QUEUE)
            return stats, attributes.visible + attributes.in_flight

    stats, left = asyncio.run(scenario())
    assert (stats.handled, stats.failed) == (40, 0)
    assert sorted(seen) == sorted(b"m%d" % n for n in range(40))
    assert most[0] == 4, f"at most {most[0]} handlers ran at once, with concurrency 4"
    assert left == 0, f"{left} messages left after every one was handled and deleted"


def test_max_messages_handles_that_many_and_gives_the_prefetch_back(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)

    async def handler(message: ReceivedMessage) -> None:
        await asyncio.sleep(0.01)

    async def scenario() -> tuple[ConsumerStats, int]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, 20)
            stats = await asyncio.wait_for(
                run_consumer(
                    client,
                    QUEUE,
                    handler,
                    concurrency=3,
                    visibility_timeout_ms=120_000,
                    handle_signals=False,
                    max_messages=5,
                ),
                60,
            )
            # Given back at once: the claims were for 120 s.
            return stats, (await client.attributes(QUEUE)).visible

    stats, visible = asyncio.run(scenario())
    assert stats.handled == 5
    assert visible == 15


def test_the_default_prefetch_is_ten_claims_per_worker(server_factory: ServerFactory) -> None:
    """Two workers, both held in their handlers: the stream holds twenty claims, what two
    workers receiving ten at a time would, and asks for no more until half are taken."""
    server = server_factory(SPEC)
    release = asyncio.Event()

    async def handler(message: ReceivedMessage) -> None:
        await release.wait()

    async def scenario() -> tuple[int, ConsumerStats]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, 60)
            stop = asyncio.Event()
            consumer = asyncio.create_task(
                run_consumer(client, QUEUE, handler, concurrency=2, stop=stop, handle_signals=False)
            )
            deadline = time.monotonic() + 10
            while (claimed := (await client.attributes(QUEUE)).in_flight) < 20:
                assert time.monotonic() < deadline, f"two workers' stream claimed {claimed}, not 20"
                await asyncio.sleep(0.01)
            stop.set()
            release.set()
            return claimed, await asyncio.wait_for(consumer, 60)

    claimed, stats = asyncio.run(scenario())
    assert claimed == 20
    assert (stats.handled, stats.failed) == (2, 0)


async def competitor_takes(client: AsyncClient, until: asyncio.Event) -> list[bytes]:
    """What another consumer manages to claim (for a minute) while `until` is unset."""
    taken: list[bytes] = []
    while not until.is_set():
        messages = await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
        taken += [message.body for message in messages]
        await asyncio.sleep(0.01)
    return taken


def run_one_worker_with_competitor(
    endpoint: str, *, messages: int, prefetch: int, visibility_ms: int, handling_s: float
) -> tuple[ConsumerStats, list[bytes], list[bytes]]:
    """One worker handles `messages` messages, each for `handling_s`, while the rest wait
    in its prefetch and a competitor tries to claim them: the stats, what the handler saw,
    and what the competitor claimed."""
    handled: list[bytes] = []

    async def handler(message: ReceivedMessage) -> None:
        await asyncio.sleep(handling_s)
        handled.append(message.body)

    async def scenario() -> tuple[ConsumerStats, list[bytes]]:
        async with AsyncClient(endpoint) as client:
            await send(client, messages)
            done = asyncio.Event()
            consumer = asyncio.create_task(
                run_consumer(
                    client,
                    QUEUE,
                    handler,
                    concurrency=1,
                    prefetch=prefetch,
                    visibility_timeout_ms=visibility_ms,
                    handle_signals=False,
                    max_messages=messages,
                )
            )
            deadline = time.monotonic() + 10
            # Every message claimed: the one being handled, the rest waiting in the prefetch.
            while (await client.attributes(QUEUE)).in_flight < min(messages, prefetch + 1):
                assert time.monotonic() < deadline, "the consumer did not claim its prefetch"
                await asyncio.sleep(0.01)
            competing = asyncio.create_task(competitor_takes(client, done))
            stats = await asyncio.wait_for(consumer, 60)
            done.set()
            return stats, await competing

    stats, taken = asyncio.run(scenario())
    return stats, sorted(handled), taken


def test_a_slow_handlers_message_stays_hidden_past_its_visibility_timeout(server_factory: ServerFactory) -> None:
    server = server_factory(SPEC)
    # Two and a half visibility timeouts.
    stats, handled, taken = run_one_worker_with_competitor(
        server.endpoint, messages=1, prefetch=1, visibility_ms=1_000, handling_s=2.5
    )
    assert taken == [], f"another consumer claimed {taken} while the handler ran"
    assert handled == [b"m0"]
    assert stats.handled == 1
    assert stats.heartbeats >= 3, f"{stats.heartbeats} heartbeats in 2.5 s with a 1 s visibility timeout"


def test_a_message_that_waited_in_the_prefetch_is_kept_hidden_once_its_handler_starts(
    server_factory: ServerFactory,
) -> None:
    """The second message is claimed as the first is taken and waits 1.6 s behind its
    handler. Its claim lasts 2 s: a first beat a third of the timeout after its handler
    starts (2.27 s after the claim) comes too late, and the message is claimed again, by
    the competitor or by the consumer's own stream, which then handles it twice (the old
    run_consumer did: [m0, m1, m1]). Counted from the claim, the beat comes as the handler
    starts (and the claims of waiting messages are extended too, as the next test shows)."""
    server = server_factory(SPEC)
    stats, handled, taken = run_one_worker_with_competitor(
        server.endpoint, messages=2, prefetch=1, visibility_ms=2_000, handling_s=1.6
    )
    assert handled == [b"m0", b"m1"], "a message was handled twice"
    assert taken == [], f"another consumer claimed {taken} while it waited in the prefetch"
    assert stats.handled == 2


def test_claims_waiting_in_the_prefetch_longer_than_their_timeout_are_extended(
    server_factory: ServerFactory,
) -> None:
    """Four messages, one worker taking 1 s each, a 1.5 s visibility timeout: the last one
    waits 3 s in the prefetch, twice its timeout, before its handler starts. No first beat
    can save it then; the claims of waiting messages have to be extended as they wait."""
    server = server_factory(SPEC)
    stats, handled, taken = run_one_worker_with_competitor(
        server.endpoint, messages=4, prefetch=3, visibility_ms=1_500, handling_s=1.0
    )
    assert handled == [b"m0", b"m1", b"m2", b"m3"], "a message was handled twice or not at all"
    assert taken == [], f"another consumer claimed {taken} while they waited in the prefetch"
    assert stats.handled == 4


def test_run_consumer_raises_once_its_stream_breaks_and_the_running_handler_ends(server: ServerProcess) -> None:
    ended: list[str] = []

    async def handler(message: ReceivedMessage) -> None:
        server.kill()
        await asyncio.sleep(0.5)
        ended.append(message.body.decode())

    async def scenario() -> None:
        async with AsyncClient(server.endpoint, route_directly=False) as client:
            await client.send_messages("orders", [Message(b"first")])
            with pytest.raises(ShardqError):
                await asyncio.wait_for(run_consumer(client, "orders", handler, concurrency=2, handle_signals=False), 30)

    asyncio.run(scenario())
    assert ended == ["first"], "run_consumer returned before its running handler ended"


def test_claims_last_the_queues_visibility_timeout_unless_given(server_factory: ServerFactory) -> None:
    """Without a visibility timeout of its own, run_consumer claims for the queue's (5 s
    here), as a receive does; the old default of 30 s overrode it, so a claim stranded
    on a stream a failover broke stayed hidden 30 s."""
    server = server_factory(f"{QUEUE}:shards=2,visibility=5s")
    remaining_ms: list[float] = []

    async def handler(message: ReceivedMessage) -> None:
        remaining_ms.append(message.visible_until_ms - time.time() * 1000)

    async def scenario() -> None:
        async with AsyncClient(server.endpoint) as client:
            await send(client, 3)
            await asyncio.wait_for(
                run_consumer(client, QUEUE, handler, concurrency=1, handle_signals=False, max_messages=3), 30
            )

    asyncio.run(scenario())
    assert len(remaining_ms) == 3
    assert all(0 < remaining <= 5_000 for remaining in remaining_ms), remaining_ms
