"""The consumer helper: receive, run a handler, keep the message hidden while it
runs (heartbeat) and while it waits in the prefetch, delete on success, release with
backoff on failure, dead-letter at once when the handler raises DeadLetter, and stop
cleanly on SIGTERM/SIGINT without losing or double-handling anything; a second signal
stops without waiting for the handlers still running, and gives their messages back. Its
workers share one consumer stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from queue import SimpleQueue
from typing import ParamSpec, TypeVar

from shardq.aio import AsyncClient
from shardq.consumer_streams import ConsumerStream
from shardq.errors import ShardqError
from shardq.giving_back import change_visibility_in_chunks, give_back_now
from shardq.types import EntryResult, ReceivedMessage

log = logging.getLogger(__name__)
# The server's limit on a release's reason.
MAX_RELEASE_REASON_CHARS = 1_024
# run_consumer's default prefetch: this many messages per worker, as much as one receive
# takes, so that a worker holds no more claims than one receiving ten at a time would. With
# four per worker (the earlier default, Celery's multiplier) four workers cycled in 1.34 ms
# p50 and eight in 1.44; with ten, 1.04 and 1.14, and the server spent 11-15% less CPU a
# message: credits come back in halves, so the stream's claims are larger and fewer
# (bench/LATENCY.md, the twenty-second change).
PREFETCH_PER_WORKER = 10

Handler = Callable[[ReceivedMessage], Awaitable[None] | None]
P = ParamSpec("P")
T = TypeVar("T")


class DeadLetter(Exception):
    """Raised by a run_consumer handler for a message that will never succeed (it cannot
    be parsed, it names something that does not exist): the message goes to the queue's
    dead-letter queue now, with the exception's text as its last error, rather than being
    retried until max_receive_count. On a queue without a dead-letter queue it is
    released with backoff instead, as a failure, and a warning says why."""


@dataclasses.dataclass
class ConsumerStats:
    handled: int = 0
    failed: int = 0
    heartbeats: int = 0
    # Handlers still running when `stop_now` came: their messages were given back.
    cut_off: int = 0
    # Messages whose handler raised DeadLetter, sent to the dead-letter queue.
    dead_lettered: int = 0


def stop_on_signal(stop: asyncio.Event, stop_now: asyncio.Event) -> None:
    """What SIGTERM and SIGINT do to run_consumer: the first sets `stop` (nothing new
    starts, the running handlers finish), the next `stop_now` (they are not waited for),
    as Celery's warm and cold shutdowns. A handler stuck for good could only be ended
    with SIGKILL before, its messages then hidden until their visibility timeout."""
    if not stop.is_set():
        log.warning("stopping: the running handlers finish first; signal again to stop without waiting for them")
        stop.set()
    elif not stop_now.is_set():
        log.warning("stopping now: the running handlers are not waited for; their messages are given back")
        stop_now.set()


async def _heartbeat(client: AsyncClient, queue: str, receipt: str, visibility_ms: int, stats: ConsumerStats) -> None:
    """Extend the claim now, then every third of the visibility timeout, while the handler runs."""
    period = _heartbeat_period_s(visibility_ms)
    while True:
        try:
            (result,) = await client.change_visibility(queue, [(receipt, visibility_ms)])
        except ShardqError as error:
            log.warning("heartbeat failed for a message of %s: %s", queue, error)
        else:
            if not result.ok:
                log.warning("heartbeat refused (%s): the message may be handled twice", result.reason)
                return
            stats.heartbeats += 1
        await asyncio.sleep(period)


async def _keep_waiting_claims(
    client: AsyncClient, queue: str, stream: ConsumerStream, visibility_ms: int, stats: ConsumerStats
) -> None:
    """Extend the claims of prefetched messages still waiting for a free worker once a third
    of their visibility has passed, as a handler's heartbeat does: behind slow handlers a
    message could otherwise wait out its claim here and be delivered again elsewhere (or
    to this consumer a second time) while still queued."""
    period = _heartbeat_period_s(visibility_ms)
    # Receipt -> this client's wall time when this keeper last extended its claim.
    extended: dict[str, float] = {}
    while True:
        # Checked twice a period: a claim is extended at the latest half its timeout in.
        await asyncio.sleep(period / 2)
        now = time.time()
        waiting = stream.waiting()
        extended = {m.receipt: extended[m.receipt] for m in waiting if m.receipt in extended}
        due = [m.receipt for m in waiting if now - extended.get(m.receipt, _claimed_at_s(m, visibility_ms)) >= period]
        for receipt, result in await change_visibility_in_chunks(
            client, queue, due, visibility_ms, "extend the claims of"
        ):
            if result.ok:
                extended[receipt] = now
                stats.heartbeats += 1
            else:  # taken and deleted meanwhile, most likely
                log.debug("a prefetched message's claim was not extended: %s", result.reason)


def _heartbeat_period_s(visibility_ms: int) -> float:
    return max(visibility_ms / 3000, 0.05)


def _claimed_at_s(message: ReceivedMessage, visibility_ms: int) -> float:
    """When the message was claimed, in the server's wall-clock seconds: its visible_until
    less the visibility timeout the claim was made with."""
    return (message.visible_until_ms - visibility_ms) / 1000


def _first_beat_delay_s(message: ReceivedMessage, visibility_ms: int) -> float:
    """Seconds until a third of the claim's visibility has passed, counted from the claim
    (the server's visible_until less the timeout), not from when the handler started: a
    message that waited in the prefetch behind busy handlers gets its first beat sooner,
    at once if it waited that long. Clocks apart by less than two thirds of the timeout
    still beat in time; the delay is never longer than a period."""
    period = _heartbeat_period_s(visibility_ms)
    if message.visible_until_ms <= 0:
        return period
    return min(period, max(0.0, _claimed_at_s(message, visibility_ms) + period - time.time()))


async def _acknowledge(
    act: Callable[[list[str]], Awaitable[list[EntryResult]]], message: ReceivedMessage, what: str
) -> bool:
    """Delete, release or dead-letter; a failure only means the message is delivered again
    later (a refused dead-letter is then released by the caller)."""
    try:
        (result,) = await act([message.receipt])
    except ShardqError as error:
        log.warning("%s of %s failed (%s); it will be delivered again", what, message.message_id, error)
        return False
    if not result.ok:
        log.warning("%s of %s refused: %s", what, message.message_id, result.reason)
    return result.ok


async def run_consumer(
    client: AsyncClient,
    queue: str,
    handler: Handler,
    *,
    concurrency: int = 8,
    visibility_timeout_ms: int | None = None,
    stop: asyncio.Event | None = None,
    stop_now: asyncio.Event | None = None,
    handle_signals: bool = True,
    max_messages: int | None = None,
    stats: ConsumerStats | None = None,
    prefetch: int | None = None,
) -> ConsumerStats:
    """Consume until `stop` is set, a signal arrives, or `max_messages` were handled.

    Stopping starts nothing new and waits for the handlers running; `stop_now` (or a
    second signal) waits for none: an async handler is cancelled, and a handler in a
    thread, which Python cannot stop, is left running (the threads do not hold the
    process at exit). Their messages are given back at once (`stats.cut_off`), so one
    cut off late in its work may be handled again, as at-least-once delivery allows.

    `concurrency` workers share one consumer stream, each handling one message at a
    time. An async handler (an async function, an object whose `__call__` is async, or
    a `functools.partial` of either) runs on the loop; any other runs on one of
    `concurrency` threads of run_consumer's own, and an awaitable it returns is awaited
    on the loop. A message is deleted once its handler (and that awaitable) completed;
    a handler that raises, `asyncio.CancelledError` included, has its message released
    with backoff, unless the CancelledError is run_consumer's own ending; one that
    raises DeadLetter has it dead-lettered at once (`stats.dead_lettered`).
    Pass `stats` to watch the counts while it runs. Claims last `visibility_timeout_ms`,
    by default the queue's own visibility timeout, as a receive without one does.

    `prefetch` is the stream's credits: how many claimed messages may wait here for a
    free worker (default: ten per worker, what a worker receiving ten at a time holds).
    Each claim, push and credit grant costs the server a commit or a frame, so fast
    handlers go faster with more (four workers: 2,880 msg/s with 16, 3,262 with 40;
    bench/LATENCY.md). Claims still waiting a third of the visibility timeout in are
    extended like a running handler's, so none expires while queued here. Lower it
    when several consumers share a queue of slow messages, so that one does not hoard
    what the others could be handling.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if prefetch is None:
        prefetch = PREFETCH_PER_WORKER * concurrency
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1, got {prefetch}")
    stop = stop or asyncio.Event()
    stop_now = stop_now or asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(signum, stop_on_signal, stop, stop_now)
    stats = stats if stats is not None else ConsumerStats()
    if visibility_timeout_ms is None:
        # The queue's own, as its owner chose it. A fixed default here (30 s) overrode it,
        # and a claim stranded on a stream broken by a failover, which nothing could give
        # back, stayed hidden that long: 30 s where the demo's queue says 5 s.
        settings = await client.queue_settings(queue)
        visibility_timeout_ms = int(settings.get("visibility_timeout_ms", 0))
    visibility_ms = visibility_timeout_ms
    # With no visibility timeout nothing is hidden, so no claim needs extending.
    keeps_claims = visibility_ms > 0
    # Prefetched, never handled: given back at the end, not left to their visibility timeout.
    unstarted: list[ReceivedMessage] = []
    # Handlers not waited for (stop_now): their messages are given back too.
    cut_off: list[ReceivedMessage] = []
    cutting_off = False
    # Set by `stop`, or when run_consumer itself is cancelled: nothing new starts after it.
    ending = asyncio.Event()
    taking = asyncio.Lock()
    started = 0
    # Workers waiting for a message: the end cancels them (the stream may stay quiet).
    waiting: set[asyncio.Task[None]] = set()

    def end() -> None:
        ending.set()
        for worker in waiting:
            worker.cancel()

    async with (
        _handler_threads(handler, concurrency) as threads,
        client.consume(queue, credits=prefetch, visibility_timeout_ms=visibility_ms) as stream,
    ):
        messages = stream.messages()

        async def next_message() -> ReceivedMessage | None:
            nonlocal started
            # One async generator for every worker: they take turns asking it.
            async with taking:
                if ending.is_set() or (max_messages is not None and started >= max_messages):
                    return None
                message = await anext(messages, None)
                if message is not None and ending.is_set():
                    unstarted.append(message)  # it arrived with the end: nothing new starts after it
                    return None
                started += 1
                return message

        async def handle(message: ReceivedMessage) -> None:
            # A timer, not a task per message: most handlers finish long before the first beat.
            beat: asyncio.Task[None] | None = None

            def start_beating() -> None:
                nonlocal beat
                beat = loop.create_task(_heartbeat(client, queue, message.receipt, visibility_ms, stats))

            timer = (
                loop.call_later(_first_beat_delay_s(message, visibility_ms), start_beating) if keeps_claims else None
            )
            try:
                await _run_handler(handler, message, threads)
            except (Exception, asyncio.CancelledError) as error:
                if isinstance(error, asyncio.CancelledError) and _is_being_cancelled():
                    # The end of run_consumer (or of its loop) reached this worker: not
                    # the handler's failure. Its message is neither deleted nor released,
                    # and given back when run_consumer stopped without waiting for it.
                    if cutting_off:
                        cut_off.append(message)
                    raise
                # Anything else is the handler's, a CancelledError too (one it awaited of an
                # inner task, say): let through, it ended its worker silently (with the last
                # one, run_consumer returned as if stopped) and left its message claimed.
                failure = _describe_failure(error)
                _stop_beating(timer, beat)
                # The error goes with the message: its dead-letter copy will say it.
                reason = failure[:MAX_RELEASE_REASON_CHARS]
                # DeadLetter: to the dead-letter queue now; where that is refused (the queue
                # has none), released as any failure, so the message is never lost.
                if isinstance(error, DeadLetter) and await _acknowledge(
                    functools.partial(stream.dead_letter, reason=reason), message, "dead-letter"
                ):
                    stats.dead_lettered += 1
                    return
                log.warning(
                    "handler failed for message %s (%s); releasing it with backoff",
                    message.message_id,
                    failure,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                stats.failed += 1
                await _acknowledge(functools.partial(stream.release, reason=reason), message, "release")
            else:
                _stop_beating(timer, beat)
                if await _acknowledge(stream.delete, message, "delete"):
                    stats.handled += 1
            finally:
                _stop_beating(timer, beat)

        async def work() -> None:
            # Each worker takes its next message as soon as its last one is acknowledged, in
            # the same loop turn as the answer: the workers that answer woke then share one
            # acknowledgement frame (and one commit) for their next messages. A dispatcher
            # starting a task per message took several loop turns to do so, and split four
            # workers' deletes into frames of one and three (bench/LATENCY.md).
            worker = asyncio.current_task()
            assert worker is not None
            while True:
                waiting.add(worker)
                try:
                    message = await next_message()
                except asyncio.CancelledError:
                    if ending.is_set():
                        return  # the end came while this worker waited for a message
                    raise
                finally:
                    waiting.discard(worker)
                if message is None:
                    return
                await handle(message)

        keeping: asyncio.Task[None] | None = None
        if keeps_claims:
            keeping = loop.create_task(_keep_waiting_claims(client, queue, stream, visibility_ms, stats))
        watching = loop.create_task(stop.wait())
        watching.add_done_callback(lambda watched: None if watched.cancelled() else end())
        workers = [loop.create_task(work()) for _ in range(concurrency)]

        def cut_off_handlers(watched: asyncio.Task[bool]) -> None:
            nonlocal cutting_off
            if watched.cancelled():
                return
            cutting_off = True
            end()
            for worker in workers:
                worker.cancel()

        watching_now = loop.create_task(stop_now.wait())
        watching_now.add_done_callback(cut_off_handlers)
        try:
            await asyncio.wait(workers)
        finally:
            watching.cancel()
            if keeping is not None:
                keeping.cancel()
            if not all(worker.done() for worker in workers):
                end()  # run_consumer itself was cancelled: the handlers running finish first
                await asyncio.wait(workers)  # unless stop_now comes meanwhile
            watching_now.cancel()
            stats.cut_off += len(cut_off)
            # Prefetched but never handled: give them back now, not at their visibility timeout.
            unstarted.extend(await stream.close())
            await give_back_now(client, queue, unstarted + cut_off)
    for worker in workers:
        failure = None if worker.cancelled() else worker.exception()
        if failure is not None:
            raise failure  # the stream broke (the workers still running finished first)
    return stats


def _is_async_callable(handler: object) -> bool:
    """Whether calling `handler` only makes a coroutine, so that it is called on the loop:
    an async function, an object whose `__call__` is async, or a partial of either.
    inspect.iscoroutinefunction alone says no to the object, and to a partial of it."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    if inspect.iscoroutinefunction(handler):
        return True
    # Looked up on the type, as a call does.
    return inspect.iscoroutinefunction(type(handler).__call__)


class _HandlerThreads(concurrent.futures.Executor):
    """`count` daemon threads taking calls in turn. ThreadPoolExecutor's threads are
    joined when the interpreter exits, so one handler stuck in its thread held the process
    after run_consumer had stopped without waiting for it: only SIGKILL ended it."""

    def __init__(self, count: int) -> None:
        self._calls: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"shardq-handler-{n}", daemon=True) for n in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return  # cancelled while it waited for a thread
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # the handler's, SystemExit included: its caller's to judge
                future.set_exception(error)
            else:
                future.set_result(result)

        self._calls.put(call)
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Each thread ends once the calls submitted before are done (one whose future was
        cancelled is skipped); a thread stuck in its handler never ends, and is waited for
        only with `wait`. `cancel_futures` is the Executor signature's, and unused."""
        for _ in self._threads:
            self._calls.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


@contextlib.asynccontextmanager
async def _handler_threads(handler: Handler, count: int) -> AsyncIterator[_HandlerThreads | None]:
    """Threads of run_consumer's own for a handler not async, one per worker: the loop's
    default executor has min(32, CPUs + 4), and on two CPUs ran 6 handlers of 16 workers
    at once. None for an async handler, which needs none."""
    if _is_async_callable(handler):
        yield None
        return
    threads = _HandlerThreads(count)
    try:
        yield threads
    finally:
        # Without waiting: run_consumer has waited for its handlers already, except when it
        # stopped without waiting, and a handler stuck in its thread must not hold it up then.
        threads.shutdown(wait=False)


async def _run_handler(handler: Handler, message: ReceivedMessage, threads: _HandlerThreads | None) -> None:
    """Run the handler to completion: on the loop when async (`threads` is None), otherwise
    in a thread, with the caller's context as asyncio.to_thread has it. An awaitable the
    thread brings back (`lambda m: handle(m)` of an async `handle`, say) is awaited on the
    loop: discarded, its message was deleted although the handler's body never ran."""
    if threads is None:
        outcome = handler(message)
    else:
        call = functools.partial(contextvars.copy_context().run, handler, message)
        outcome = await asyncio.get_running_loop().run_in_executor(threads, call)
    if inspect.isawaitable(outcome):
        await outcome


def _is_being_cancelled() -> bool:
    """Whether the current task was asked to stop (Task.cancelling), as opposed to having a
    CancelledError raised through it by something it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _describe_failure(error: BaseException) -> str:
    """The exception's type and message, or its type alone when it has no message (a bare
    CancelledError would otherwise read "CancelledError: ")."""
    detail = str(error)
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def _stop_beating(timer: asyncio.TimerHandle | None, beat: asyncio.Task[None] | None) -> None:
    if timer is not None:
        timer.cancel()
    if beat is not None:
        beat.cancel()
