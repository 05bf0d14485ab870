"""The consumer helper: receive, run a handler, keep the message hidden while it
runs (heartbeat), delete on success, release with backoff on failure, and stop
cleanly on SIGTERM/SIGINT without losing or double-handling anything."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from shardq.aio import AsyncClient
from shardq.errors import ShardqError
from shardq.types import EntryResult, ReceivedMessage

log = logging.getLogger(__name__)
# The server's limits on receipts in one call, and on a release's reason.
MAX_RECEIPTS_PER_CALL = 1_000
MAX_RELEASE_REASON_CHARS = 1_024

Handler = Callable[[ReceivedMessage], Awaitable[None] | None]


@dataclasses.dataclass
class ConsumerStats:
    handled: int = 0
    failed: int = 0
    heartbeats: int = 0


async def _heartbeat(client: AsyncClient, queue: str, receipt: str, visibility_ms: int, stats: ConsumerStats) -> None:
    """Extend the claim every third of the visibility timeout while the handler runs."""
    period = max(visibility_ms / 3000, 0.05)
    while True:
        await asyncio.sleep(period)
        try:
            (result,) = await client.change_visibility(queue, [(receipt, visibility_ms)])
        except ShardqError as error:
            log.warning("heartbeat failed for a message of %s: %s", queue, error)
            continue
        if not result.ok:
            log.warning("heartbeat refused (%s): the message may be handled twice", result.reason)
            return
        stats.heartbeats += 1


async def _acknowledge(
    act: Callable[[list[str]], Awaitable[list[EntryResult]]], message: ReceivedMessage, what: str
) -> bool:
    """Delete or release; a failure only means the message is delivered again later."""
    try:
        (result,) = await act([message.receipt])
    except ShardqError as error:
        log.warning("%s of %s failed (%s); it will be delivered again", what, message.message_id, error)
        return False
    if not result.ok:
        log.warning("%s of %s refused: %s", what, message.message_id, result.reason)
    return result.ok


async def _next(messages: AsyncIterator[ReceivedMessage]) -> ReceivedMessage:
    return await anext(messages)


async def run_consumer(
    client: AsyncClient,
    queue: str,
    handler: Handler,
    *,
    concurrency: int = 8,
    visibility_timeout_ms: int = 30_000,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
    max_messages: int | None = None,
    stats: ConsumerStats | None = None,
) -> ConsumerStats:
    """Consume until `stop` is set, a signal arrives, or `max_messages` were handled.

    A synchronous handler runs in a worker thread; an async one on the loop.
    Pass `stats` to watch the counts while it runs.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(signum, stop.set)
    stats = stats if stats is not None else ConsumerStats()
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()
    unstarted: list[ReceivedMessage] = []

    async with client.consume(queue, credits=concurrency, visibility_timeout_ms=visibility_timeout_ms) as stream:

        async def handle(message: ReceivedMessage) -> None:
            beat = asyncio.create_task(_heartbeat(client, queue, message.receipt, visibility_timeout_ms, stats))
            try:
                if inspect.iscoroutinefunction(handler):
                    await handler(message)
                else:
                    await asyncio.to_thread(handler, message)
            except Exception as error:
                log.warning(
                    "handler failed for message %s (%s); releasing it with backoff",
                    message.message_id,
                    error,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                stats.failed += 1
                beat.cancel()
                # The error goes with the message: its dead-letter copy will say it.
                reason = f"{type(error).__name__}: {error}"[:MAX_RELEASE_REASON_CHARS]
                await _acknowledge(functools.partial(stream.release, reason=reason), message, "release")
            else:
                beat.cancel()
                if await _acknowledge(stream.delete, message, "delete"):
                    stats.handled += 1
            finally:
                beat.cancel()
                slots.release()

        messages = stream.messages()
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                if max_messages is not None and stats.handled + stats.failed + len(running) >= max_messages:
                    if not running:
                        break
                    await asyncio.wait(set(running), return_when=asyncio.FIRST_COMPLETED)
                    continue
                await slots.acquire()
                next_message: asyncio.Task[ReceivedMessage] = asyncio.create_task(_next(messages))
                done, _ = await asyncio.wait({next_message, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if next_message not in done:
                    next_message.cancel()
                    await asyncio.wait({next_message})
                    if not next_message.cancelled() and next_message.exception() is None:
                        unstarted.append(next_message.result())  # it arrived as we stopped
                    slots.release()
                    break
                try:
                    message = next_message.result()
                except StopAsyncIteration:
                    slots.release()
                    break
                if stop.is_set():
                    # The stop arrived with this message: nothing new starts after a stop.
                    unstarted.append(message)
                    slots.release()
                    break
                task = asyncio.create_task(handle(message))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            stopping.cancel()
            if running:
                await asyncio.wait(set(running))
            # Prefetched but never handled: give them back now, not at their visibility timeout.
            unstarted.extend(await stream.close())
            await _give_back(client, queue, unstarted)
    return stats


async def _give_back(client: AsyncClient, queue: str, messages: list[ReceivedMessage]) -> None:
    for start in range(0, len(messages), MAX_RECEIPTS_PER_CALL):
        chunk = messages[start : start + MAX_RECEIPTS_PER_CALL]
        try:
            results = await client.change_visibility(queue, [(message.receipt, 0) for message in chunk])
        except ShardqError as error:
            log.warning("could not give back %d prefetched messages (%s): visible again after their timeout",
                        len(chunk), error)  # fmt: skip
            continue
        refused = sum(1 for result in results if not result.ok)
        if refused:
            log.warning("%d prefetched messages could not be given back: visible again after their timeout", refused)
