"""Client: the blocking face of AsyncClient, for scripts and threads.

It runs one AsyncClient on a private event-loop thread, so blocking callers get
the same batching and streams: `send()` from many threads is folded into
producer-stream batches exactly as concurrent coroutines are.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from shardq import client_loops
from shardq.aio import DEFAULT_ENDPOINT, AsyncClient
from shardq.consumer import ConsumerStats, run_consumer, stop_on_signal
from shardq.tls import ClientTls, client_tls
from shardq.types import EntryResult, Message, QueueAttributes, ReceivedMessage, RedriveProgress, SendResult, ShardRoute

T = TypeVar("T")


class Client:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        route_directly: bool = True,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        tls: ClientTls | bool | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`route_directly=False` for a client outside the cluster's network (it cannot
        reach the leaders' addresses): the endpoint forwards every call. `token`,
        `token_file`, `metadata`: for servers that authenticate their clients; `tls`,
        `ca_file`: for servers that serve TLS (AsyncClient says how)."""
        self.endpoint = endpoint
        # Before the loop thread is taken: a CA file that cannot be read raises here.
        resolved_tls = client_tls(tls, ca_file)
        # uvloop when installed (SHARDQ_EVENT_LOOP=asyncio for the standard loop): a call
        # costs about a third less client CPU and latency on it. A closed Client's loop
        # thread serves the next one (client_loops says why).
        self._loop_thread = client_loops.take()
        self._loop = self._loop_thread.loop
        self._closed = False
        self._async = self._run(
            self._create(endpoint, route_directly, token, token_file, tuple(metadata), resolved_tls)
        )

    @staticmethod
    async def _create(
        endpoint: str,
        route_directly: bool,
        token: str | None,
        token_file: str | os.PathLike[str] | None,
        metadata: tuple[tuple[str, str], ...],
        tls: ClientTls | None,
    ) -> AsyncClient:
        return AsyncClient(
            endpoint,
            route_directly=route_directly,
            token=token,
            token_file=token_file,
            metadata=metadata,
            # Resolved already: plaintext here means plaintext, whatever the environment says.
            tls=tls or False,
        )

    def _run(self, awaitable: Awaitable[T]) -> T:
        if self._closed:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never to run: no "was never awaited" warning for it
            raise RuntimeError("this Client is closed: make a new one")

        async def wrapped() -> T:
            return await awaitable

        future = asyncio.run_coroutine_threadsafe(wrapped(), self._loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted (Ctrl-C) or given up on: the call stops too, as a blocking call
            # would. Left running on the loop thread, an abandoned long poll claimed the
            # next message for nobody, and an abandoned send could be stored beside the
            # caller's retry.
            future.cancel()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._run(self._shutdown())
        finally:
            self._closed = True
        client_loops.give_back(self._loop_thread)

    async def _shutdown(self) -> None:
        """Close the client, then finish every task still on the loop (gRPC's own
        stream pumps included, left pending when a server died), so the next Client
        given this loop finds nothing of this one's on it."""
        await self._async.close()
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    def send_messages(self, queue: str, messages: Sequence[Message]) -> list[SendResult]:
        return self._run(self._async.send_messages(queue, messages))

    def send_messages_streamed(self, queue: str, messages: Sequence[Message]) -> list[SendResult]:
        return self._run(self._async.send_messages_streamed(queue, messages))

    def send(
        self,
        queue: str,
        body: bytes,
        *,
        attributes: Mapping[str, str] | None = None,
        group_id: str = "",
        dedup_id: str = "",
        delay_ms: int | None = None,
        priority: int = 0,
    ) -> SendResult:
        return self._run(
            self._async.send(
                queue,
                body,
                attributes=attributes,
                group_id=group_id,
                dedup_id=dedup_id,
                delay_ms=delay_ms,
                priority=priority,
            )
        )

    def receive_messages(
        self,
        queue: str,
        *,
        max_messages: int = 10,
        visibility_timeout_ms: int | None = None,
        wait_time_ms: int | None = None,
        delete_on_receive: bool = False,
    ) -> list[ReceivedMessage]:
        return self._run(
            self._async.receive_messages(
                queue,
                max_messages=max_messages,
                visibility_timeout_ms=visibility_timeout_ms,
                wait_time_ms=wait_time_ms,
                delete_on_receive=delete_on_receive,
            )
        )

    def delete_messages(self, queue: str, receipts: Sequence[str]) -> list[EntryResult]:
        return self._run(self._async.delete_messages(queue, receipts))

    def change_visibility(self, queue: str, changes: Sequence[tuple[str, int]]) -> list[EntryResult]:
        return self._run(self._async.change_visibility(queue, changes))

    def release_messages(
        self, queue: str, receipts: Sequence[str], *, reason: str = "", dead_letter: bool = False
    ) -> list[EntryResult]:
        return self._run(self._async.release_messages(queue, receipts, reason=reason, dead_letter=dead_letter))

    def purge(self, queue: str) -> int:
        return self._run(self._async.purge(queue))

    def attributes(self, queue: str) -> QueueAttributes:
        return self._run(self._async.attributes(queue))

    def describe(self, queue: str) -> list[ShardRoute]:
        return self._run(self._async.describe(queue))

    def list_queues(self, prefix: str = "", *, dead_letter_queue: str = "") -> list[str]:
        return self._run(self._async.list_queues(prefix, dead_letter_queue=dead_letter_queue))

    def peek_messages(self, queue: str, *, max_messages: int = 10) -> list[ReceivedMessage]:
        return self._run(self._async.peek_messages(queue, max_messages=max_messages))

    def create_queue(self, queue: str, settings: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self._run(self._async.create_queue(queue, settings))

    def delete_queue(self, queue: str) -> int:
        return self._run(self._async.delete_queue(queue))

    def set_queue_attributes(self, queue: str, settings: Mapping[str, str]) -> dict[str, Any]:
        return self._run(self._async.set_queue_attributes(queue, settings))

    def queue_settings(self, queue: str) -> dict[str, Any]:
        return self._run(self._async.queue_settings(queue))

    def run_consumer(
        self,
        queue: str,
        handler: Callable[[ReceivedMessage], None],
        *,
        concurrency: int = 8,
        visibility_timeout_ms: int | None = None,
        max_messages: int | None = None,
        prefetch: int | None = None,
    ) -> ConsumerStats:
        """Blocking consumer loop (see shardq.consumer.run_consumer); SIGTERM/SIGINT stop it
        cleanly, and a second one stops it without waiting for the handlers running."""
        stop = self._run(self._make_event())
        stop_now = self._run(self._make_event())
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(
                    signum, lambda *_: self._loop.call_soon_threadsafe(stop_on_signal, stop, stop_now)
                )
        try:
            return self._run(
                run_consumer(
                    self._async,
                    queue,
                    handler,
                    concurrency=concurrency,
                    visibility_timeout_ms=visibility_timeout_ms,
                    stop=stop,
                    stop_now=stop_now,
                    handle_signals=False,
                    max_messages=max_messages,
                    prefetch=prefetch,
                )
            )
        finally:
            for signum, handler_before in previous.items():
                signal.signal(signum, handler_before)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def redrive(
        self, *, source: str, destination: str = "", rate_per_second: float = 0, max_messages: int = 0
    ) -> Iterator[RedriveProgress]:
        progress_iterator = self._async.redrive(
            source=source, destination=destination, rate_per_second=rate_per_second, max_messages=max_messages
        )
        while True:
            try:
                yield self._run(anext(progress_iterator))
            except StopAsyncIteration:
                return
