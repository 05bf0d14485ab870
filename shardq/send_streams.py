"""AsyncClient's sends ride a stream: the batches of `send_messages` go out on a producer
stream per leader (the endpoint's when the client does not route directly), as those of
`send()` and `send_messages_streamed` do, not as unary calls.

Why: as for deletes (shardq.ack_streams), a unary call in grpc.aio is a new call at
both ends, and on an open stream a request is one message each way. One caller's send
took 1.15 ms p50 unary and 0.94 ms over the producer stream, four callers' sends made
3,118 and 4,193 calls/s (bench/LATENCY.md).

What a caller sees is what a unary SendMessages gave it:
- results per message; a request the server refuses whole (INVALID_ARGUMENT,
  QUEUE_FULL, QUEUE_NOT_FOUND...) raises with the same class, so the client's batching
  still sends a refused shared request again call by call;
- NOT_LEADER, and a batch that never reached the server (the stream could not connect,
  had ended, or the server ended it while stopping, which it does only after answering
  every batch it read), go by the unary call, which asks the endpoint and waits for a
  restarting server as before;
- a stream that broke with the batch on it, an UNAVAILABLE answer, or no answer within
  the unary call's deadline, raise OutcomeUnknown, as a unary send cut off mid-call
  does; except that where the unary path sent such a batch again (to a leader, every
  message with a dedup id, so a repeat stores nothing new), it goes again by the unary
  call here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from shardq.api.v1 import queue_pb2
from shardq.errors import NotLeader, OutcomeUnknown, Reason, ShardqError, Unavailable
from shardq.stream_pool import Stream, StreamPool

# As long as a unary send's deadline (AsyncClient._routed).
ANSWER_TIMEOUT_S = 30.0


class SendStream(Stream, Protocol):
    """What this module needs of a producer stream (aio.ProducerStream)."""

    async def send_batch(self, request: queue_pb2.SendMessagesRequest) -> queue_pb2.SendMessagesResponse: ...


# Opens a producer stream to a leader (None: the endpoint).
OpenStream = Callable[[str | None], Awaitable[SendStream]]
# The same send as a unary call, routed as unary calls are.
UnarySend = Callable[[], Awaitable[queue_pb2.SendMessagesResponse]]


class SendStreams:
    """A client's producer streams, by leader address (event loop only)."""

    def __init__(self, open_stream: OpenStream) -> None:
        self._pool: StreamPool[str | None, SendStream] = StreamPool(open_stream)

    async def send(
        self,
        address: str | None,
        request: queue_pb2.SendMessagesRequest,
        *,
        sent_again_when_unknown: bool,
        unary: UnarySend,
    ) -> queue_pb2.SendMessagesResponse:
        """Send `request` to the leader at `address` (None: the endpoint).
        `sent_again_when_unknown`: the unary path would send it again after a connection
        failed mid-call (see the module docstring)."""
        stream = await self._pool.get(address)
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):  # no task per batch, as wait_for makes
                return await stream.send_batch(request)
        except TimeoutError:
            self._pool.drop(address, stream)
            if sent_again_when_unknown:
                return await unary()
            raise OutcomeUnknown(f"a send on the producer stream was not answered in {ANSWER_TIMEOUT_S:g} s") from None
        except ShardqError as error:
            broke = stream.ended
            if broke:
                self._pool.drop(address, stream)
            if isinstance(error, NotLeader):
                return await unary()  # nothing stored: the unary path asks the endpoint
            if broke and (isinstance(error, Unavailable) or error.reason is Reason.SHUTTING_DOWN):
                return await unary()  # never reached the server (see the module docstring)
            if isinstance(error, Unavailable | OutcomeUnknown):
                if sent_again_when_unknown:
                    return await unary()
                if isinstance(error, Unavailable):  # an answer: as a unary call's UNAVAILABLE
                    raise OutcomeUnknown(f"a send may or may not have been stored ({error.message})") from None
            raise

    async def close(self) -> None:
        await self._pool.close()
