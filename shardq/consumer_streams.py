"""ConsumerStream: messages pushed by the server against credits, with acknowledgements
on the same stream (AsyncClient.consume opens one)."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from shardq.ack_streams import MAX_ACK_BATCH, MAX_ACKS_IN_FLIGHT
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coalescing import Coalescer
from shardq.converting import received_from_proto
from shardq.errors import OutcomeUnknown, ShardqError, Unavailable
from shardq.status import entry_results_from_proto, error_from_rpc, error_from_stream, unknown_if_sent
from shardq.types import EntryResult, ReceivedMessage


class ConsumerStream:
    """Server push with credits: the server sends at most as many messages as granted.

    Each message taken from `messages()` returns one credit, so the number
    buffered client-side stays bounded; `release()` rides the same stream and
    resolves when the server answers. `delete()` is the client's `delete_messages`:
    the deletes of every stream and caller of one client share requests, where each
    stream's own went alone (four workers on streams of their own deleted one message
    at a time in 1.43 ms p50, in two commits a round, against 0.67 ms for one worker:
    bench/LATENCY.md), and a receipt stays good for a delete after its stream ended.
    """

    def __init__(
        self,
        stub: queue_pb2_grpc.QueueServiceStub,
        queue: str,
        *,
        credits: int,
        visibility_timeout_ms: int | None,
        max_batch: int,
        delete: Callable[[Sequence[str]], Awaitable[list[EntryResult]]],
        give_back: Callable[[list[ReceivedMessage]], Awaitable[None]] | None = None,
    ) -> None:
        self.queue = queue
        self._delete = delete
        # Makes messages visible again now (AsyncClient.consume passes run_consumer's own).
        self._give_back = give_back
        self._stub = stub
        self._credits = credits
        self._visibility_timeout_ms = visibility_timeout_ms
        self._max_batch = max_batch
        self._requests: asyncio.Queue[queue_pb2.ConsumeRequest | None] = asyncio.Queue()
        # Received and not yet taken, oldest first: the reader extends it a whole frame at
        # a time (a queue operation per message cost more than building the message) and
        # sets `_arrived`; `waiting()` reads it.
        self._ready: collections.deque[ReceivedMessage] = collections.deque()
        self._arrived = asyncio.Event()
        # Once the stream has ended, and why it broke (None for a clean end).
        self._ended = False
        self._failure: ShardqError | None = None
        self._acks: dict[int, asyncio.Future[queue_pb2.AckResult]] = {}
        self._ack_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None
        self._returned_credits = 0
        self._releases: Coalescer[str, EntryResult] = Coalescer(
            self._release_now, max_batch=MAX_ACK_BATCH, max_in_flight=MAX_ACKS_IN_FLIGHT
        )

    async def __aenter__(self) -> ConsumerStream:
        start = queue_pb2.ConsumeStart(queue=self.queue, max_batch=self._max_batch)
        if self._visibility_timeout_ms is not None:
            start.visibility_timeout_ms = self._visibility_timeout_ms
        self._requests.put_nowait(queue_pb2.ConsumeRequest(start=start))
        self._requests.put_nowait(queue_pb2.ConsumeRequest(credits=self._credits))
        self._call = self._stub.ConsumeStream(self._request_iterator())  # type: ignore[arg-type]  # as above
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Received and never taken, they are claimed for nobody: back to the queue now, not at
        # their visibility timeout (400 credits stranded 399 messages for it after one was
        # taken). close() hands them over only once, so those a caller's own close() took
        # are theirs, and are not given back here.
        untaken = await self.close()
        if untaken and self._give_back is not None:
            await self._give_back(untaken)

    async def _request_iterator(self) -> AsyncIterator[queue_pb2.ConsumeRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                if response.HasField("messages"):
                    self._ready.extend(received_from_proto(response.messages))
                    self._arrived.set()
                else:
                    future = self._acks.pop(response.ack.ack_id, None)
                    if future is not None and not future.done():
                        future.set_result(response.ack)
            self._end(None)
            self._fail_acks(OutcomeUnknown("the consumer stream ended with acknowledgements unanswered"))
        except grpc.RpcError as error:
            failure = error_from_rpc(error, queue=self.queue)
            self._end(failure)
            self._fail_acks(
                unknown_if_sent(error, failure, "the consumer stream broke with acknowledgements in flight")
            )

    def _end(self, failure: ShardqError | None) -> None:
        self._ended, self._failure = True, failure
        self._arrived.set()

    def _fail_acks(self, failure: ShardqError) -> None:
        acks, self._acks = self._acks, {}
        for future in acks.values():
            if not future.done():
                future.set_exception(failure)

    async def messages(self) -> AsyncIterator[ReceivedMessage]:
        # Credits go back once half of them were taken, as HTTP/2 gives back its
        # flow-control window. Each grant costs a frame at both ends and a claim, a
        # commit, on the server: given back in quarters, 10 credits meant a grant and a
        # claim of two every other message for a consumer taking one message at a time,
        # and in halves four stream workers took 16% more messages a second (README,
        # Latency). Half still leaves the server the other half to push meanwhile.
        if self._reader is None:
            # Never opened: nothing would ever arrive, and the loop below waited for good.
            raise RuntimeError("open the consumer stream first: `async with client.consume(queue) as stream:`")
        half = max(1, self._credits // 2)
        while True:
            if not self._ready:
                if self._ended:  # after every message received before the end
                    if self._failure is None:
                        return
                    raise self._failure
                self._arrived.clear()
                await self._arrived.wait()
                continue
            message = self._ready.popleft()
            self._returned_credits += 1
            if self._returned_credits >= half:
                self._requests.put_nowait(queue_pb2.ConsumeRequest(credits=self._returned_credits))
                self._returned_credits = 0
            yield message

    async def _acknowledge(
        self, *, delete: Sequence[str], release: Sequence[str], reason: str = "", dead_letter: Sequence[str] = ()
    ) -> queue_pb2.AckResult:
        if self._reader is not None and self._reader.done():
            # Nobody would ever answer it (a delete then waited forever, and so did
            # run_consumer, which waits for its handlers: found by the demo's failover).
            raise Unavailable("the consumer stream has ended: open another to acknowledge")
        ack_id = next(self._ack_ids)
        # Built before its future is registered: a receipt of the wrong type raises here, and
        # a future registered first was failed at the stream's end with nobody to retrieve it.
        acknowledge = queue_pb2.Acknowledge(
            ack_id=ack_id, receipts=delete, release=release, release_reason=reason, dead_letter=dead_letter
        )
        future: asyncio.Future[queue_pb2.AckResult] = asyncio.get_running_loop().create_future()
        self._acks[ack_id] = future
        self._requests.put_nowait(queue_pb2.ConsumeRequest(ack=acknowledge))
        return await future

    @property
    def ended(self) -> bool:
        """The stream ended or broke: nothing sent on it now would be answered."""
        return self._ended or (self._reader is not None and self._reader.done())

    async def acknowledge_deletes(self, receipts: Sequence[str]) -> queue_pb2.AckResult:
        """One acknowledgement frame deleting `receipts`, not shared with other calls, and
        its answer as the server gave it (`failed` set when refused whole). Raises
        Unavailable when the stream ended or broke first, as `release` does."""
        return await self._acknowledge(delete=receipts, release=())

    async def _release_now(self, receipts: list[str]) -> list[EntryResult]:
        return entry_results_from_proto((await self._acknowledge(delete=(), release=receipts)).released)

    def waiting(self) -> list[ReceivedMessage]:
        """The messages received and not yet taken from `messages()`, oldest first. They
        are claimed, so their visibility timeouts run while they wait (run_consumer
        extends those that wait long)."""
        return list(self._ready)

    async def delete(self, receipts: Sequence[str]) -> list[EntryResult]:
        """Delete as the client's `delete_messages` does (see the class docstring): with the
        deletes of the client's other callers and streams, to each receipt's leader. As
        before, any number of receipts: more than one request holds go in several."""
        return await self._delete(receipts)

    async def release(self, receipts: Sequence[str], *, reason: str = "") -> list[EntryResult]:
        """Release (nack with backoff) over the stream; concurrent calls without a
        reason share frames. A `reason` is kept as the messages' last error."""
        if reason:
            # A frame holds at most MAX_ACK_BATCH receipts, as the server bounds them.
            results: list[EntryResult] = []
            for start in range(0, len(receipts), MAX_ACK_BATCH):
                chunk = receipts[start : start + MAX_ACK_BATCH]
                answer = await self._acknowledge(delete=(), release=chunk, reason=reason)
                results += entry_results_from_proto(answer.released)
            return results
        return await self._releases.add_many(receipts)

    async def dead_letter(self, receipts: Sequence[str], *, reason: str = "") -> list[EntryResult]:
        """Dead-letter now over the stream, whatever the messages' receive counts (as the
        client's `release_messages(..., dead_letter=True)`); `reason` is kept as their
        last error and carried to the dead-letter copies. A frame refused whole raises
        its error: InvalidArgument on a queue without a dead-letter queue, before anything
        was acted on."""
        results: list[EntryResult] = []
        for start in range(0, len(receipts), MAX_ACK_BATCH):
            chunk = receipts[start : start + MAX_ACK_BATCH]
            answer = await self._acknowledge(delete=(), release=(), reason=reason, dead_letter=chunk)
            if answer.HasField("failed") and not answer.dead_lettered:
                raise error_from_stream(answer.failed, queue=self.queue)
            results += entry_results_from_proto(answer.dead_lettered)
        return results

    async def close(self) -> list[ReceivedMessage]:
        """End the stream. Returns the messages it received that were never taken from
        `messages()`: they are still claimed, and the caller should give them back (leaving
        `async with` without calling this gives them back itself). A later call returns none."""
        self._requests.put_nowait(None)
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), timeout=5)
            except TimeoutError:
                self._reader.cancel()
            except asyncio.CancelledError:
                # The reader ends cancelled when gRPC cancels the call under it (grpc.aio
                # raises CancelledError from a cancelled call's reads): the stream has
                # ended, which is what closing asks. Only this task's own cancellation
                # goes on (a CI run saw run_consumer fail with the reader's).
                current = asyncio.current_task()
                if not self._reader.cancelled() or (current is not None and current.cancelling()):
                    raise
        if self._call is not None:
            self._call.cancel()
        untaken = list(self._ready)
        self._ready.clear()
        return untaken
