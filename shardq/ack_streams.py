"""AsyncClient's deletes ride a stream: one acknowledgement-only consumer stream per queue
and leader (granted no credits, so nothing is ever pushed to it), opened on first use.

Why a stream: in grpc.aio a unary call is a new call at both ends. The server learns of
it, reads its request and sends its answer in three steps, each handed from gRPC's
polling thread to the event loop; on an open stream a request is one message each way.
Stamped along four workers' deletes (bench/LATENCY.md): 343 µs p50 from the client
handing a unary delete to gRPC to the server's handler starting, 168 µs back, around a
handler of 287 µs. One caller's delete took 1.06 ms p50 unary and 0.73 ms on a stream.

What a caller sees is what a unary DeleteMessages gave it:
- results per receipt, each caller its own (the client's batching is unchanged: it
  decides what goes out together, this only carries it);
- an error the server raises for the whole request (the queue was deleted, the server is
  shutting down) raises here with the same class (AckResult.failed), and NOT_LEADER goes
  to the unary path, which asks the endpoint as it always did;
- a batch that never reached the server goes by the unary path, which waits for a
  restarting server as before: the stream could not connect, had ended, or the server
  ended it while shutting down, which it does only after answering every
  acknowledgement it read (the server's ConsumeStream);
- a stream that broke with the batch on it raises OutcomeUnknown, as a unary delete
  whose connection failed does, and so does an answer that does not come within the
  unary call's deadline.

A stream that failed in any way is dropped, and the next batch opens another
(shardq.stream_pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from shardq.api.v1 import queue_pb2
from shardq.errors import NotLeader, OutcomeUnknown, Reason, ShardqError, Unavailable
from shardq.status import entry_results_from_proto, error_from_stream
from shardq.stream_pool import Stream, StreamPool
from shardq.types import EntryResult

# Receipts in one delete or release request (the server refuses more), and such requests
# in flight at once per stream or batcher.
MAX_ACK_BATCH = 1000
MAX_ACKS_IN_FLIGHT = 2

# As long as a unary delete's deadline (AsyncClient._routed).
ANSWER_TIMEOUT_S = 30.0


class AcknowledgementStream(Stream, Protocol):
    """What this module needs of a consumer stream (consumer_streams.ConsumerStream)."""

    async def acknowledge_deletes(self, receipts: Sequence[str]) -> queue_pb2.AckResult: ...


# Opens a queue's acknowledgement stream to a leader ("" for the endpoint): (queue, address).
OpenStream = Callable[[tuple[str, str]], Awaitable[AcknowledgementStream]]
# The same delete as a unary call, routed as unary calls are.
UnaryDelete = Callable[[], Awaitable[list[EntryResult]]]


class AcknowledgementStreams:
    """A client's acknowledgement streams, by queue and leader address (event loop only)."""

    def __init__(self, open_stream: OpenStream) -> None:
        self._pool: StreamPool[tuple[str, str], AcknowledgementStream] = StreamPool(open_stream)

    async def delete(self, queue: str, address: str, receipts: list[str], unary: UnaryDelete) -> list[EntryResult]:
        """Delete `receipts` (1 to MAX_ACK_BATCH of them) of `queue` at the leader at `address`."""
        key = (queue, address)
        stream = await self._pool.get(key)
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):  # no task per batch, as wait_for makes
                answer = await stream.acknowledge_deletes(receipts)
        except TimeoutError:
            self._pool.drop(key, stream)
            raise OutcomeUnknown(
                f"a delete on the acknowledgement stream was not answered in {ANSWER_TIMEOUT_S:g} s"
            ) from None
        except ShardqError as error:
            self._pool.drop(key, stream)
            if isinstance(error, Unavailable) or error.reason is Reason.SHUTTING_DOWN:
                return await unary()  # never reached the server (see the module docstring)
            raise
        if answer.HasField("failed"):
            self._pool.drop(key, stream)  # e.g. the queue it was opened on is gone
            failure = error_from_stream(answer.failed, queue=queue)
            if isinstance(failure, NotLeader):
                return await unary()
            if isinstance(failure, Unavailable):  # as a unary call's UNAVAILABLE answer, for a delete
                raise OutcomeUnknown(f"a delete may or may not have been applied ({failure.message})")
            raise failure
        return entry_results_from_proto(answer.deleted)

    async def close(self) -> None:
        await self._pool.close()
