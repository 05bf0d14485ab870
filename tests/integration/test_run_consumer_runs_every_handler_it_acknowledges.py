"""run_consumer on a real server deletes a message only once its handler ran to the end:
an awaitable a handler returns is awaited (a lambda calling an async function, an object
whose `__call__` is async), a CancelledError a handler raises releases its message like
any failure and the worker goes on, and `concurrency` synchronous handlers run at once
(not the loop's default executor's few)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from shardq import AsyncClient, Message, run_consumer
from shardq.consumer import ConsumerStats, Handler
from shardq.types import ReceivedMessage
from tests.support.servers import ServerFactory

QUEUE = "work"
SPEC = f"{QUEUE}:shards=2"
# Long enough that a claim left behind is still in flight when the test looks.
CLAIM_MS = 120_000


async def send(client: AsyncClient, bodies: list[bytes]) -> None:
    await client.send_messages(QUEUE, [Message(body) for body in bodies])


async def consume(client: AsyncClient, handler: Handler, *, concurrency: int, count: int) -> ConsumerStats:
    """run_consumer until `count` messages were handled or failed, within 60 s."""
    return await asyncio.wait_for(
        run_consumer(
            client,
            QUEUE,
            handler,
            concurrency=concurrency,
            visibility_timeout_ms=CLAIM_MS,
            handle_signals=False,
            max_messages=count,
        ),
        60,
    )


async def left_in_queue(client: AsyncClient) -> tuple[int, int]:
    """(in flight, visible or waiting out a release's backoff)."""
    attributes = await client.attributes(QUEUE)
    return attributes.in_flight, attributes.visible + attributes.delayed


class Recorder:
    """What the handlers' bodies saw: each body, and whether it ran on the loop's thread."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.on_loop_thread: list[bool] = []

    async def record(self, message: ReceivedMessage, label: str = "") -> None:
        # Suspends first: a body that is not awaited to its end records nothing.
        await asyncio.sleep(0.01)
        self.on_loop_thread.append(threading.current_thread() is threading.main_thread())
        self.bodies.append(message.body)


class AsyncCall:
    """A handler object whose `__call__` is async."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def __call__(self, message: ReceivedMessage, label: str = "") -> None:
        await self.recorder.record(message, label)


HANDLER_FORMS: dict[str, Callable[[Recorder], Handler]] = {
    "lambda calling an async function": lambda recorder: lambda message: recorder.record(message, "x"),
    "object whose __call__ is async": AsyncCall,
    "partial of an object whose __call__ is async": lambda recorder: functools.partial(AsyncCall(recorder), label="x"),
    # Handled on the loop before the fix too; here so that it stays so.
    "partial of an async function": lambda recorder: functools.partial(recorder.record, label="x"),
}


@pytest.mark.parametrize("form", list(HANDLER_FORMS))
def test_a_handler_returning_an_awaitable_runs_its_body_before_the_message_is_deleted(
    server_factory: ServerFactory, form: str
) -> None:
    """The lambda and the objects ran in a thread, their coroutines were dropped ("never
    awaited") and every message was counted handled and deleted, no body having run."""
    server = server_factory(SPEC)
    recorder = Recorder()
    handler = HANDLER_FORMS[form](recorder)
    bodies = [b"m%d" % n for n in range(6)]

    async def scenario() -> tuple[ConsumerStats, tuple[int, int]]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, bodies)
            stats = await consume(client, handler, concurrency=3, count=len(bodies))
            return stats, await left_in_queue(client)

    stats, left = asyncio.run(scenario())
    assert sorted(recorder.bodies) == bodies, f"the handler's body ran for {recorder.bodies}"
    assert all(recorder.on_loop_thread), "a handler's coroutine ran off the loop's thread"
    assert (stats.handled, stats.failed) == (len(bodies), 0)
    assert left == (0, 0)


def test_an_awaitable_from_a_sync_handler_that_fails_releases_its_message(server_factory: ServerFactory) -> None:
    """Awaited, its exception is the handler's: the message is released, not deleted."""
    server = server_factory(SPEC)

    async def fail(message: ReceivedMessage) -> None:
        await asyncio.sleep(0.01)
        raise ValueError(f"cannot handle {message.body!r}")

    def handler(message: ReceivedMessage) -> Awaitable[None]:
        # Not async itself: run in a thread, it hands back the coroutine that does the work.
        return fail(message)

    async def scenario() -> tuple[ConsumerStats, tuple[int, int]]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, [b"doomed"])
            stats = await consume(client, handler, concurrency=1, count=1)
            return stats, await left_in_queue(client)

    stats, left = asyncio.run(scenario())
    assert (stats.handled, stats.failed) == (0, 1)
    assert left == (0, 1), f"(in flight, visible or backing off) = {left}: the message was not released"


def test_a_handler_raising_cancelled_error_releases_its_message_and_its_worker_goes_on(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler awaiting an inner task that was cancelled gets its CancelledError. It used
    to end the worker: with one worker, run_consumer returned as if stopped, without a
    word, and the message stayed claimed for its whole visibility timeout."""
    server = server_factory(SPEC)
    fine = [b"m0", b"m1", b"m2"]
    handled: list[bytes] = []

    async def handler(message: ReceivedMessage) -> None:
        if message.body == b"cancelled":
            inner = asyncio.create_task(asyncio.sleep(60))
            inner.cancel()
            await inner
        handled.append(message.body)

    async def scenario() -> tuple[ConsumerStats, tuple[int, int]]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, [b"cancelled", *fine])
            stats = await consume(client, handler, concurrency=1, count=1 + len(fine))
            return stats, await left_in_queue(client)

    with caplog.at_level(logging.WARNING, logger="shardq.consumer"):
        stats, left = asyncio.run(scenario())
    assert sorted(handled) == fine
    assert (stats.handled, stats.failed) == (len(fine), 1)
    assert left == (0, 1), f"(in flight, visible or backing off) = {left}: the message was not released"
    failures = [record.getMessage() for record in caplog.records if "handler failed" in record.getMessage()]
    assert len(failures) == 1, failures
    assert "(CancelledError)" in failures[0]


def test_cancelling_run_consumer_still_stops_it_once_the_running_handler_ends(server_factory: ServerFactory) -> None:
    """Its own cancellation is not a handler's CancelledError: the running handler ends
    and its message is deleted, nothing new starts, the prefetch is given back, and the
    caller gets its CancelledError."""
    server = server_factory(SPEC)
    started: list[bytes] = []
    may_finish = asyncio.Event()

    async def handler(message: ReceivedMessage) -> None:
        started.append(message.body)
        await may_finish.wait()

    async def scenario() -> tuple[ConsumerStats, tuple[int, int]]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, [b"m%d" % n for n in range(5)])
            stats = ConsumerStats()
            consumer = asyncio.create_task(
                run_consumer(
                    client,
                    QUEUE,
                    handler,
                    concurrency=1,
                    visibility_timeout_ms=CLAIM_MS,
                    handle_signals=False,
                    stats=stats,
                )
            )
            deadline = time.monotonic() + 10
            while not started:
                assert time.monotonic() < deadline, "no handler started"
                await asyncio.sleep(0.01)
            consumer.cancel()
            await asyncio.sleep(0.1)
            assert not consumer.done(), "run_consumer ended before its running handler"
            may_finish.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(consumer, 30)
            return stats, await left_in_queue(client)

    stats, left = asyncio.run(scenario())
    assert len(started) == 1, f"handlers started after the cancellation: {started}"
    assert (stats.handled, stats.failed) == (1, 0)
    assert left == (0, 4)


def test_concurrency_sync_handlers_run_at_once_and_their_threads_end_with_run_consumer(
    server_factory: ServerFactory,
) -> None:
    """Sixteen synchronous handlers wait for each other. On the loop's default executor,
    min(32, CPUs + 4) threads (6 on two CPUs), the barrier timed out and all failed."""
    server = server_factory(SPEC)
    workers = 16
    barrier = threading.Barrier(workers, timeout=10)
    handler_threads: list[threading.Thread] = []

    def handler(message: ReceivedMessage) -> None:
        handler_threads.append(threading.current_thread())
        barrier.wait()

    async def scenario() -> tuple[ConsumerStats, tuple[int, int], list[threading.Thread]]:
        async with AsyncClient(server.endpoint) as client:
            await send(client, [b"m%d" % n for n in range(workers)])
            stats = await consume(client, handler, concurrency=workers, count=workers)
            # Still on the loop: the threads end with run_consumer, not with asyncio.run.
            deadline = time.monotonic() + 10
            while alive := [thread for thread in set(handler_threads) if thread.is_alive()]:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            return stats, await left_in_queue(client), alive

    stats, left, alive = asyncio.run(scenario())
    assert (stats.handled, stats.failed) == (workers, 0), "the sixteen handlers did not all run at once"
    assert len(set(handler_threads)) == workers
    assert left == (0, 0)
    assert alive == [], f"{len(alive)} handler threads outlived run_consumer"
