"""Reading a stream's requests until its client ends them, or until the server, stopping,
stops reading (QueueServicer.end_request_streams): the producer stream and the consume
stream's acknowledgements both end this way, after answering every request they read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc

from shardq.errors import Reason, ShardqError

# How a stream the server stopped reading ends: what its client sent and got no answer
# for was never read, so the client may send it elsewhere.
STOPPED_READING = ShardqError(Reason.SHUTTING_DOWN, "the server is shutting down; what went unanswered was not read")

Request = TypeVar("Request")


class RequestReading(Generic[Request]):
    """Hands each request of `requests` to `take`, which starts its work as a task in
    `in_progress`; once the client ends its side, or `stop()` stops the reading, waits for
    that work and calls `ended` with None, or with STOPPED_READING when stopped."""

    def __init__(
        self,
        requests: AsyncIterator[Request],
        context: grpc.aio.ServicerContext[Any, Any],
        take: Callable[[Request], Awaitable[None]],
        in_progress: set[asyncio.Task[None]],
        ended: Callable[[ShardqError | None], None],
    ) -> None:
        self._requests = requests
        self._context = context
        self._take = take
        self._in_progress = in_progress
        self._ended = ended
        # Until the client's side ends: stopping after that would cut off the answers it
        # waits for, not its requests.
        self._reading = True
        self._stopping = False
        self.task = asyncio.create_task(self._read())

    def stop(self) -> None:
        """Read no more requests; the work of those read still gets answered."""
        if self._reading and not self._stopping:
            self._stopping = True
            self.task.cancel()

    async def _read(self) -> None:
        ending: ShardqError | None = None
        try:
            try:
                async for request in self._requests:
                    await self._take(request)
                await self._tell_vanished_from_closed()
            except asyncio.CancelledError:
                if not self._stopping:
                    raise
                ending = STOPPED_READING
            self._reading = False
            if self._in_progress:
                await asyncio.wait(set(self._in_progress))
        finally:
            self._ended(ending)

    async def _tell_vanished_from_closed(self) -> None:
        """One more read once the requests end, so that a client that vanished ends the
        stream cancelled rather than as one that closed its side.

        grpc.aio ends the requests of a vanished client (SIGKILLed, its connection reset)
        as it ends those of a client that closed its side: the stream then ended as if
        asked to, and was counted OK. The call is cancelled too, but that reaches the
        handler's task separately, and under load (a CI run; 2 runs in 28 of a test on a
        machine kept busy) only after the handler had finished. This read is answered at
        once either way (end of stream, or failed); gRPC delivers answers in order, so a
        vanished client's cancellation, which came before, has been delivered by then,
        and the handler ends cancelled (0 runs in 85 counted OK)."""
        # Not once the handler has ended the call (aborted it): reads then raise.
        if not self._context.done():
            await self._context.read()
