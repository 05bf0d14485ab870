"""AsyncClient: every queue operation in batches, plus the streaming fast paths.

A unary gRPC call costs enough that one Python client and server top out near
4,500 calls/s, while a bidirectional stream carries about three times as many
exchanges. So `send()` of single messages is batched transparently onto a
producer stream, and `consume()` opens a consumer stream with credits and
acknowledgements on the same stream; the unary SQS-style calls stay for
everything else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from shardq.ack_streams import MAX_ACK_BATCH, MAX_ACKS_IN_FLIGHT, AcknowledgementStreams
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.bearer_tokens import bearer_token, with_token
from shardq.channel_options import RESOLVE_AGAIN_WITHIN_HALF_A_SECOND
from shardq.coalescing import Coalescer, Companions, Item, Result, WokenTogether
from shardq.consumer_streams import ConsumerStream
from shardq.converting import message_to_proto, received_from_proto, send_results_from_proto, settings_from_proto
from shardq.durations import MAX_DURATION_MS
from shardq.errors import InvalidArgument, NotLeader, QueueFull, Unavailable
from shardq.giving_back import give_back_now
from shardq.queues import MAX_RECEIVE_BATCH, MAX_RECEIVE_SHARES, MAX_WAIT_MS
from shardq.receipts import MalformedReceipt, decode_receipt
from shardq.receive_shares import split_shares
from shardq.routing import choose_shard, content_dedup_id
from shardq.send_streams import SendStreams
from shardq.status import (
    entry_results_from_proto,
    error_from_rpc,
    error_from_stream,
    host_unresolved,
    never_sent,
    unknown_if_sent,
)
from shardq.tls import ClientTls, aio_channel, client_tls
from shardq.types import (
    EntryResult,
    Message,
    QueueAttributes,
    ReceivedMessage,
    RedriveProgress,
    SendResult,
    ShardAttributes,
    ShardRoute,
)

DEFAULT_ENDPOINT = "localhost:7600"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Reconnect promptly after a server restart (gRPC's default first backoff is 1 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    RESOLVE_AGAIN_WITHIN_HALF_A_SECOND,
]


async def _connects_within(channel: grpc.aio.Channel, seconds: float) -> bool:
    """Whether `channel` is connected (READY) within `seconds`."""
    try:
        await asyncio.wait_for(channel.channel_ready(), seconds)
    except TimeoutError:
        return False
    return True


Key = TypeVar("Key")

# Transparent batching: how many single sends ride in one batch, and how many
# batches per queue may be in flight before new sends wait to join the next.
MAX_AUTO_BATCH = 500
MAX_BATCHES_IN_FLIGHT = 8
# Every unary call has a deadline: a paused or partitioned server must not hang callers.
DEFAULT_CALL_TIMEOUT_S = 30.0
# How long a call waits for a channel that cannot connect yet (a server restarting)
# before it reports the server unreachable.
CONNECT_GRACE_S = 3.0
# Shared short polls (of up to MAX_RECEIVE_SHARES callers each) in flight at once per queue.
MAX_RECEIVES_IN_FLIGHT = 4
# A unary send shares a request with other callers' only when its bodies and attributes
# come to at most this: MAX_AUTO_BATCH such messages stay well inside the server's
# MAX_BATCH_BYTES, and a large send gains nothing from company.
MAX_SHARED_SEND_BYTES = 64 * 1024


def _small_enough_to_share(messages: Sequence[Message]) -> bool:
    """Whether the messages' bodies and attributes come to at most MAX_SHARED_SEND_BYTES;
    stops counting once past it."""
    size = 0
    for message in messages:
        size += len(message.body) + len(message.group_id) + len(message.dedup_id)
        if message.attributes:
            size += sum(len(key.encode()) + len(value.encode()) for key, value in message.attributes.items())
        if size > MAX_SHARED_SEND_BYTES:
            return False
    return True


def _refused_whole_for_a_part(error: Exception) -> bool:
    """Whether the server refused a whole request, storing nothing, for what some of its
    parts alone may not share: one invalid message or timeout (INVALID_ARGUMENT), or more
    messages than the queue has room for (QUEUE_FULL: a shard's part of a send is stored
    whole or not at all, and fewer messages may fit)."""
    return isinstance(error, (InvalidArgument, QueueFull))


def _send_request(queue: str, shard: int | None, messages: Sequence[Message]) -> queue_pb2.SendMessagesRequest:
    try:
        request = queue_pb2.SendMessagesRequest(queue=queue, messages=[message_to_proto(m) for m in messages])
    except (TypeError, ValueError, AttributeError):
        raise _unsendable(messages) from None
    if shard is not None:
        request.shard = shard
    return request


def _any_shard_may_take(request: queue_pb2.SendMessagesRequest) -> bool:
    """Whether no message of the send names a group or a dedup id (which choose the
    shard): the shard the client chose for it may then be any other."""
    return not any(message.group_id or message.dedup_id for message in request.messages)


def _unpinned(request: queue_pb2.SendMessagesRequest) -> queue_pb2.SendMessagesRequest:
    """The send without the shard the client chose for it: for the endpoint to place on a
    shard that is led, when the chosen shard's leader cannot be reached."""
    unpinned = queue_pb2.SendMessagesRequest()
    unpinned.CopyFrom(request)
    unpinned.ClearField("shard")
    return unpinned


class ProducerStream:
    """One SendStream: batches go out tagged with an id; answers come back by id."""

    def __init__(self, stub: queue_pb2_grpc.QueueServiceStub) -> None:
        self._requests: asyncio.Queue[queue_pb2.SendStreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[queue_pb2.SendMessagesResponse]] = {}
        # Which queue each waiting batch went to: refusals name it.
        self._queues: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._call = stub.SendStream(self._request_iterator())  # type: ignore[arg-type]  # aio stubs take async iterators
        self._reader = asyncio.create_task(self._read_answers())

    async def _request_iterator(self) -> AsyncIterator[queue_pb2.SendStreamRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read_answers(self) -> None:
        try:
            async for answer in self._call:  # type: ignore[attr-defined]  # an aio call is async-iterable
                future = self._waiting.pop(answer.request_id, None)
                queue = self._queues.pop(answer.request_id, "")
                if future is None or future.done():
                    continue
                if answer.HasField("error"):
                    future.set_exception(error_from_stream(answer.error, queue=queue))
                else:
                    future.set_result(answer.response)
        except grpc.RpcError as error:
            # A repeat of a batch called UNAVAILABLE ("nothing applied") may store it twice.
            failure = unknown_if_sent(error, error_from_rpc(error), "the producer stream broke with batches in flight")
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(failure)
            self._waiting.clear()
        except asyncio.CancelledError:
            for future in self._waiting.values():
                future.cancel()
            raise

    @property
    def ended(self) -> bool:
        """The stream ended or broke: nothing sent on it now would be answered."""
        return self._reader.done()

    async def send_batch(self, request: queue_pb2.SendMessagesRequest) -> queue_pb2.SendMessagesResponse:
        """Send one SendMessagesRequest on the stream; its answer, or the error the server
        refused it with (raised as a unary call's would be), or the stream's failure."""
        if self.ended:
            raise Unavailable("the producer stream has closed")
        request_id = next(self._ids)
        future: asyncio.Future[queue_pb2.SendMessagesResponse] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._queues[request_id] = request.queue
        self._requests.put_nowait(queue_pb2.SendStreamRequest(request_id=request_id, batch=request))
        return await future

    async def close(self) -> None:
        self._requests.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=5)
        except (TimeoutError, grpc.RpcError):
            self._reader.cancel()
        self._call.cancel()


@dataclasses.dataclass(frozen=True, slots=True)
class _QueueRoutes:
    shards: int
    fifo: bool
    content_based_dedup: bool
    # Per shard, the leader's address ("" while unknown).
    leaders: list[str]


def _with_content_dedup_ids(messages: Sequence[Message]) -> list[Message]:
    """The messages, each sent without a dedup id given its body's (shardq.routing)."""
    return [
        dataclasses.replace(message, dedup_id=content_dedup_id(message.body))
        # A body of the wrong type is left for _send_request to name.
        if not message.dedup_id and isinstance(message.body, bytes)
        else message
        for message in messages
    ]


Learned = TypeVar("Learned")


async def _asked_once(
    learning: dict[str, asyncio.Future[Learned]], queue: str, ask: Callable[[str], Awaitable[Learned]]
) -> Learned:
    """`ask(queue)`, asked once however many callers wait for it (`learning` holds the
    lookups in flight, by queue)."""
    lookup = learning.get(queue)
    if lookup is None:
        lookup = learning[queue] = asyncio.ensure_future(ask(queue))
        lookup.add_done_callback(functools.partial(_learned, learning, queue))
    # Shielded: a caller that gives up does not cancel the others' lookup.
    return await asyncio.shield(lookup)


def _learned(learning: dict[str, Any], queue: str, lookup: asyncio.Future[Any]) -> None:
    """A lookup asked once for many callers ended: the next asks again if it must."""
    if learning.get(queue) is lookup:
        del learning[queue]
    if not lookup.cancelled():
        lookup.exception()  # retrieved: every waiter may have given up


def _unsendable(messages: Sequence[Message]) -> InvalidArgument:
    """The first message protobuf cannot hold (a `str` body, a non-string attribute, a delay
    past int64), named as the server names a message it refuses: the bare TypeError or
    ValueError said neither which message nor which field."""
    for position, message in enumerate(messages):
        try:
            message_to_proto(message)
        except (TypeError, ValueError, AttributeError) as error:
            return InvalidArgument(f"messages[{position}]", f"cannot be sent as given: {error}")
    return InvalidArgument("messages", "cannot be sent as given")


_INT64_MIN, _INT64_END = -(2**63), 2**63


def _check_duration(field: str, ms: int | None) -> None:
    """A duration the request cannot hold (past int64) raised protobuf's bare ValueError:
    refused here, naming the field, as the server refuses the ones it can hold but not take."""
    if ms is not None and not _INT64_MIN <= ms < _INT64_END:
        raise InvalidArgument(field, f"must be 0..{MAX_DURATION_MS} ms, got {ms}")


def _check_receive_count(max_messages: int) -> None:
    """A count the request cannot hold (negative, or past uint32) raised protobuf's bare
    ValueError: refused here as the server refuses the counts it can hold but not take."""
    if not 0 <= max_messages < 2**32:
        raise InvalidArgument("max_messages", f"must be 1..{MAX_RECEIVE_BATCH}, got {max_messages}")


class AsyncClient:
    """asyncio client for a shardq server or cluster. Use `async with AsyncClient(...)`.

    `endpoint` is any server. With `route_directly` (the default) the client
    learns each queue's shard map (DescribeQueue) and sends its calls straight
    to shard leaders, refreshing the map on NOT_LEADER or an unreachable
    leader; otherwise, and for `send()` and `consume()`, the endpoint forwards
    as needed. Sends and deletes travel on streams kept open per leader
    (shardq.send_streams, shardq.ack_streams), answered as unary calls would be.

    For servers that authenticate their clients, `token` or `token_file` (a projected
    ServiceAccount token, read again as the kubelet rewrites it) is sent with every
    call; without either, the file SHARDQ_TOKEN_FILE names, if set (shardq.bearer_tokens).
    `metadata` goes with every call too: the operator's own calls carry the cluster's peer
    secret in it, which servers take in place of a token.

    For servers that serve TLS, `tls` (a `ClientTls`, or True for the system's roots) or
    `ca_file`; without either, what SHARDQ_CA_FILE / SHARDQ_TLS say (shardq.tls). Every
    channel the client opens, to the endpoint and to leaders, speaks TLS then.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        channel: grpc.aio.Channel | None = None,
        route_directly: bool = True,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        tls: ClientTls | bool | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._token = bearer_token(token, token_file)
        self._metadata = tuple(metadata)
        self._tls = client_tls(tls, ca_file)
        self._channel = channel or aio_channel(endpoint, self._tls, CHANNEL_OPTIONS)
        self._stub = with_token(queue_pb2_grpc.QueueServiceStub(self._channel), self._token, self._metadata)
        # Every send's batches go out on these streams (shardq.send_streams).
        self._send_streams = SendStreams(self._open_send_stream)
        self._batchers: dict[str, Coalescer[Message, SendResult]] = {}
        # Per (queue, leader address or None for the endpoint, shard, idempotent):
        # concurrent small unary sends share one request.
        self._senders: dict[tuple[str, str | None, int | None, bool], Coalescer[Message, SendResult]] = {}
        # Per (queue, leader address): concurrent unary deletes (and visibility changes)
        # share one request.
        self._deleters: dict[tuple[str, str], Coalescer[str, EntryResult]] = {}
        self._visibility_changers: dict[tuple[str, str], Coalescer[tuple[str, int], EntryResult]] = {}
        # The deleters' batches go out on these streams (shardq.ack_streams).
        self._ack_streams = AcknowledgementStreams(self._open_ack_stream)
        # Per (queue, visibility timeout): concurrent short polls share one request.
        self._receivers: dict[tuple[str, int | None, bool], Coalescer[int, list[ReceivedMessage]]] = {}
        # Per queue, its receive wait as the last answer from it said: a receive that gives
        # none is a short poll (and may share a request) when this is 0.
        self._queue_receive_waits: dict[str, int] = {}
        # Shared by the unary batchers: callers one shared answer woke make their next
        # calls (a receive answered, then a delete) together too.
        self._woken = WokenTogether()
        # Per queue: its receive and delete batchers, whose calls workers make in turn.
        self._companions: dict[str, Companions] = {}
        # Messages of shared receives whose callers gave up, on their way back to the queue.
        self._giving_back: set[asyncio.Task[list[EntryResult]]] = set()
        self._route_directly = route_directly
        self._routes: dict[str, _QueueRoutes] = {}
        # Per queue: the shard-map lookup in flight, which the calls that need it share.
        self._learning_routes: dict[str, asyncio.Future[_QueueRoutes]] = {}
        self._learning_receive_waits: dict[str, asyncio.Future[int]] = {}
        self._leader_channels: dict[str, grpc.aio.Channel] = {}
        self._leader_stubs: dict[str, queue_pb2_grpc.QueueServiceAsyncStub] = {}
        self._round_robin = itertools.count()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._giving_back:  # before the channels close under them
            await asyncio.wait(set(self._giving_back), timeout=5)
        await self._send_streams.close()
        await self._ack_streams.close()
        for channel in self._leader_channels.values():
            await channel.close()
        await self._channel.close()

    def _coalescer_for(
        self,
        coalescers: dict[Key, Coalescer[Item, Result]],
        key: Key,
        submit: Callable[[list[Item]], Awaitable[Sequence[Result]]],
        *,
        max_batch: int,
        max_in_flight: int,
        unwanted: Callable[[list[Result]], None] | None = None,
        companions_of: str | None = None,
    ) -> Coalescer[Item, Result]:
        """`coalescers[key]`, made on first use with `submit`. A shared unary request the
        server refuses whole for what some of its calls hold goes again call by call;
        `unwanted` gets the answers of callers that gave up meanwhile; every unary batcher
        shares the client's WokenTogether, and those made `companions_of` a queue share
        its Companions (looked up only when the batcher is made)."""
        coalescer = coalescers.get(key)
        if coalescer is None:
            coalescer = coalescers[key] = Coalescer(
                submit,
                max_batch=max_batch,
                max_in_flight=max_in_flight,
                alone_on=_refused_whole_for_a_part,
                unwanted=unwanted,
                woken=self._woken,
                companions=None if companions_of is None else self._companions_of(companions_of),
            )
        return coalescer

    # -- routing ---------------------------------------------------------------------
    async def _routes_for(self, queue: str) -> _QueueRoutes | None:
        """The queue's shard map when calls should go to several leaders, else None."""
        if not self._route_directly:
            return None
        routes = self._routes.get(queue)
        if routes is None:
            routes = await self._learn_routes(queue)
        if len(set(routes.leaders)) <= 1:
            return None  # one server leads everything: the endpoint is as good as any
        return routes

    async def _learn_routes(self, queue: str) -> _QueueRoutes:
        """The queue's shard map, asked once however many calls wait for it: a burst of
        first calls that each asked (thousands at a client's start, or after a failover
        dropped the map) crowded out the calls themselves."""
        return await _asked_once(self._learning_routes, queue, self._describe_routes)

    async def _learn_receive_wait(self, queue: str) -> int:
        """The queue's receive wait, asked once however many receives wait for it (a
        burst of first receives each sent alone, not knowing whether it may wait, shared
        no request); later answers to receives keep it up to date."""
        return await _asked_once(self._learning_receive_waits, queue, self._describe_receive_wait)

    async def _describe_receive_wait(self, queue: str) -> int:
        description = await self._unary(
            self._stub.DescribeQueue, queue_pb2.DescribeQueueRequest(queue=queue), queue=queue
        )
        wait_ms = int(description.config.receive_wait_ms)
        self._queue_receive_waits[queue] = wait_ms
        return wait_ms

    async def _describe_routes(self, queue: str) -> _QueueRoutes:
        description = await self._unary(
            self._stub.DescribeQueue, queue_pb2.DescribeQueueRequest(queue=queue), queue=queue
        )
        routes = _QueueRoutes(
            shards=description.config.shards or len(description.shards),
            fifo=description.config.fifo,
            content_based_dedup=description.config.content_based_dedup,
            leaders=[route.leader_address for route in sorted(description.shards, key=lambda r: r.shard)],
        )
        self._routes[queue] = routes
        self._queue_receive_waits[queue] = description.config.receive_wait_ms  # while it is here
        return routes

    def _leader_stub(self, address: str) -> Any:
        if not address or address == self.endpoint:
            return self._stub
        stub = self._leader_stubs.get(address)
        if stub is None:
            channel = aio_channel(address, self._tls, CHANNEL_OPTIONS)
            self._leader_channels[address] = channel
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            stub = self._leader_stubs[address] = with_token(stub, self._token, self._metadata)
        return stub

    def _forget_routes(self, queue: str) -> None:
        self._routes.pop(queue, None)

    async def _routed(
        self,
        queue: str,
        address: str,
        method: str,
        request: Any,
        *,
        idempotent: bool,
        timeout: float = 30,
        any_shard: bool = False,
    ) -> Any:
        """Call a leader directly; if it is not the leader (nothing was written), refresh
        the map and let the endpoint (which forwards) answer instead. An unreachable
        leader may have applied the call, so only calls whose repeat gives the same
        answer are retried then: a send with dedup ids answers with the original id,
        a receive only delays what it claimed. A repeated delete would answer
        MESSAGE_NOT_FOUND for a delete that succeeded, so receipt operations raise
        OutcomeUnknown instead (the outcome is unknown to the caller).

        A call `any_shard` may serve (an unkeyed send) does not wait for this leader to
        accept a connection: the endpoint gets it at once, without the shard the client
        chose, to place on a shard that is led."""
        try:
            return await self._unary(
                getattr(self._leader_stub(address), method),
                request,
                queue=queue,
                timeout=timeout,
                idempotent=idempotent,
                channel=self._leader_channels.get(address),
                connect_grace_s=0.0 if any_shard else CONNECT_GRACE_S,
            )
        except NotLeader:
            self._forget_routes(queue)
        except Unavailable:
            # Never sent (the leader did not accept the connection): safe to ask the endpoint.
            # A failure during the call raised OutcomeUnknown instead, unless idempotent.
            self._forget_routes(queue)
        return await self._unary(
            getattr(self._stub, method),
            _unpinned(request) if any_shard else request,
            queue=queue,
            timeout=timeout,
            idempotent=idempotent,
        )

    def _addresses_of_receipts(self, routes: _QueueRoutes, receipts: Sequence[str]) -> list[str]:
        addresses = []
        for receipt in receipts:
            try:
                shard = decode_receipt(receipt).shard
            except MalformedReceipt:
                shard = -1  # the endpoint answers MALFORMED_RECEIPT for it
            addresses.append(routes.leaders[shard] if 0 <= shard < len(routes.leaders) else "")
        return addresses

    async def _per_leader(
        self,
        queue: str,
        items: Sequence[Any],
        addresses: list[str],
        call: Callable[[str, list[Any]], Awaitable[list[Any]]],
    ) -> list[Any]:
        """Run `call(address, items)` once per leader address; results back in item order."""
        groups: dict[str, list[int]] = {}
        for position, address in enumerate(addresses):
            groups.setdefault(address, []).append(position)
        results: list[Any] = [None] * len(items)

        async def run(address: str, positions: list[int]) -> None:
            for position, result in zip(positions, await call(address, [items[p] for p in positions]), strict=True):
                results[position] = result

        await asyncio.gather(*(run(address, positions) for address, positions in groups.items()))
        return results

    @property
    def stub(self) -> queue_pb2_grpc.QueueServiceStub:
        return self._stub

    async def _unary(
        self,
        method: Any,
        request: Any,
        *,
        queue: str = "",
        timeout: float = DEFAULT_CALL_TIMEOUT_S,
        idempotent: bool = True,
        channel: grpc.aio.Channel | None = None,
        connect_grace_s: float = CONNECT_GRACE_S,
    ) -> Any:
        """One call on `channel` (the endpoint's unless given). While the channel cannot
        connect (a server restarting), the call waits for it to connect, for up to
        `connect_grace_s`, and is sent again: nothing was sent, so any call may be. The
        wait is for the connection alone, never for a call already sent: a call that
        a late connection carried to the server may have been applied, so its deadline
        cannot pass for "never sent" (a send repeated on that word was stored twice).
        A connection that fails during a call that is not idempotent raises
        OutcomeUnknown: it may have been applied, and repeating it would not say."""
        loop = asyncio.get_running_loop()
        grace_ends = loop.time() + connect_grace_s
        while True:
            try:
                return await method(request, timeout=timeout)
            except grpc.RpcError as error:
                if never_sent(error):
                    remaining = grace_ends - loop.time()
                    # A restarting server comes up in a moment; a name that does not resolve
                    # does not, and waiting for it only made every such call 3 s slower.
                    if (
                        remaining > 0.05
                        and not host_unresolved(error)
                        and await _connects_within(channel or self._channel, remaining)
                    ):
                        continue
                    raise error_from_rpc(error, queue=queue) from None  # it never came up
                failure = error_from_rpc(error, queue=queue)
                if not idempotent:
                    failure = unknown_if_sent(error, failure, "the connection failed during the call")
                raise failure from None

    # -- sending -------------------------------------------------------------------
    async def send_messages(self, queue: str, messages: Sequence[Message]) -> list[SendResult]:
        """Send a batch; per-message results (some may carry an error).

        Against a cluster, each shard's part goes straight to its leader. Concurrent
        small calls to one leader (and shard) share a request, as concurrent deletes do:
        a lone call goes out at once, calls made while one is in flight go out together
        once it is answered. A shared request the server refuses whole (one call's
        invalid message, or too little room in the queue for all of it) is sent again
        call by call, so each caller gets its own answer."""
        routes = await self._routes_for(queue)
        if routes is None:
            return await self._send_to(queue, None, None, list(messages))
        if routes.content_based_dedup:
            # The server would give these ids; given here, each message goes straight to the
            # shard they choose, and the send is safe to repeat when its outcome is unknown.
            messages = _with_content_dedup_ids(messages)
        turn = next(self._round_robin)
        by_shard: dict[int, list[int]] = {}
        for position, message in enumerate(messages):
            shard = choose_shard(
                shards=routes.shards,
                fifo=routes.fifo,
                group_id=message.group_id,
                dedup_id=message.dedup_id,
                round_robin=turn,
            )
            by_shard.setdefault(shard, []).append(position)
        results: list[SendResult | None] = [None] * len(messages)

        async def send_shard(shard: int, positions: list[int]) -> None:
            part = [messages[p] for p in positions]
            for position, result in zip(
                positions, await self._send_to(queue, routes.leaders[shard], shard, part), strict=True
            ):
                results[position] = result

        await asyncio.gather(*(send_shard(shard, positions) for shard, positions in by_shard.items()))
        return [result for result in results if result is not None]

    async def _send_to(
        self, queue: str, address: str | None, shard: int | None, messages: list[Message]
    ) -> list[SendResult]:
        """Send `messages` to `address` (a leader; None: the endpoint), pinned to `shard`."""
        # A repeated send stores nothing new only when every message has a dedup id; such
        # calls share requests only with each other, so they keep that guarantee.
        idempotent = all(message.dedup_id for message in messages)
        try:
            shareable = _small_enough_to_share(messages)
        except (TypeError, AttributeError):  # a field of the wrong type: name it
            raise _unsendable(messages) from None
        if not messages or len(messages) > MAX_AUTO_BATCH or not shareable:
            # Empty and long calls are refused or answered as sent; a large one gains nothing.
            return await self._send_now(queue, address, shard, idempotent, messages)
        return await self._sender(queue, address, shard, idempotent).add_many(messages)

    async def _send_now(
        self, queue: str, address: str | None, shard: int | None, idempotent: bool, messages: list[Message]
    ) -> list[SendResult]:
        """A unary SendMessages (calls the client's batching leaves alone: empty, long, large)."""
        request = _send_request(queue, shard, messages)
        return send_results_from_proto(await self._send_unary(queue, address, idempotent, request))

    async def _send_unary(
        self, queue: str, address: str | None, idempotent: bool, request: queue_pb2.SendMessagesRequest
    ) -> queue_pb2.SendMessagesResponse:
        response: queue_pb2.SendMessagesResponse
        if address is None:
            # Nothing retries this call: cut off mid-call, it says it may have been stored
            # (OUTCOME_UNKNOWN), dedup ids or not, rather than "reached no server".
            response = await self._unary(self._stub.SendMessages, request, queue=queue, idempotent=False)
        else:
            response = await self._routed(
                queue,
                address,
                "SendMessages",
                request,
                idempotent=idempotent,
                any_shard=_any_shard_may_take(request),
            )
        return response

    async def _send_on_stream(
        self, queue: str, address: str | None, shard: int | None, idempotent: bool, messages: list[Message]
    ) -> list[SendResult]:
        """One batch of a sender, on the producer stream to `address` (shardq.send_streams:
        answered as the unary call would be, and by it where the stream never carried it)."""
        request = _send_request(queue, shard, messages)
        response = await self._send_streams.send(
            address,
            request,
            sent_again_when_unknown=address is not None and idempotent,
            unary=functools.partial(self._send_unary, queue, address, idempotent, request),
        )
        return send_results_from_proto(response)

    async def _open_send_stream(self, address: str | None) -> ProducerStream:
        return ProducerStream(self._stub if address is None else self._leader_stub(address))

    def _sender(
        self, queue: str, address: str | None, shard: int | None, idempotent: bool
    ) -> Coalescer[Message, SendResult]:
        return self._coalescer_for(
            self._senders,
            (queue, address, shard, idempotent),
            functools.partial(self._send_on_stream, queue, address, shard, idempotent),
            max_batch=MAX_AUTO_BATCH,
            max_in_flight=MAX_BATCHES_IN_FLIGHT,
        )

    async def send_messages_streamed(self, queue: str, messages: Sequence[Message]) -> list[SendResult]:
        """Like send_messages, over the shared producer stream: concurrent calls to
        the same queue are folded into one stream request. A message the server
        refused comes back with its error_reason set, as with send_messages."""
        return await self._batcher(queue).add_many(messages)

    def _batcher(self, queue: str) -> Coalescer[Message, SendResult]:
        batcher = self._batchers.get(queue)
        if batcher is None:

            async def submit(messages: list[Message]) -> list[SendResult]:
                return await self._send_on_stream(queue, None, None, False, messages)

            batcher = self._batchers[queue] = Coalescer(
                submit,
                max_batch=MAX_AUTO_BATCH,
                max_in_flight=MAX_BATCHES_IN_FLIGHT,
                # The server refuses a stream request whole, as it does a unary one.
                alone_on=_refused_whole_for_a_part,
            )
        return batcher

    async def send(
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
        """Send one message; concurrent calls are batched onto the producer stream.

        Raises the entry's error (e.g. QueueFull) if the message was not stored.
        """
        message = Message(body, dict(attributes or {}), group_id, dedup_id, delay_ms, priority)
        result = await self._batcher(queue).add(message)
        if not result.ok:
            raise error_from_stream(
                queue_pb2.StreamError(reason=result.error_reason, message=result.error_message), queue=queue
            )
        return result

    # -- receiving and acknowledging ---------------------------------------------------
    async def receive_messages(
        self,
        queue: str,
        *,
        max_messages: int = 10,
        visibility_timeout_ms: int | None = None,
        wait_time_ms: int | None = None,
        delete_on_receive: bool = False,
    ) -> list[ReceivedMessage]:
        """Claim up to `max_messages`, long-polling up to `wait_time_ms` for the first
        (None: as long as the queue's `receiveWait` says, 0 unless set, as in SQS).

        Concurrent short polls (`wait_time_ms` 0) of one queue with the same visibility
        timeout share a request, as deletes do: the server claims each caller's share
        as that caller's own receive would, in the same commits. Long polls go alone:
        a shared one would hold every caller until the slowest share ended.

        `delete_on_receive`: the messages are deleted as they are received, in the same
        commit (at most once, as pgmq's pop or AMQP's auto-ack): never handed out again,
        even if this call fails after the server acted, so such a failure raises
        OutcomeUnknown and is not retried, and a caller cancelled while its request is out
        loses what it took. Their receipts are empty. Concurrent short polls that delete
        share requests with each other (not with those that do not)."""
        _check_receive_count(max_messages)
        _check_duration("visibility_timeout_ms", visibility_timeout_ms)
        _check_duration("wait_time_ms", wait_time_ms)
        if wait_time_ms is None:
            queue_waits = self._queue_receive_waits.get(queue)
            if queue_waits is None:
                queue_waits = await self._learn_receive_wait(queue)
            if queue_waits == 0:
                wait_time_ms = 0  # the queue does not make receives wait: this one is a short poll
        if wait_time_ms == 0 and 1 <= max_messages <= MAX_RECEIVE_BATCH:
            return await self._receiver(queue, visibility_timeout_ms, delete_on_receive).add(max_messages)
        return (
            await self._receive_now(
                queue,
                visibility_timeout_ms,
                [max_messages],
                wait_time_ms=wait_time_ms,
                delete_on_receive=delete_on_receive,
            )
        )[0]

    async def _receive_now(
        self,
        queue: str,
        visibility_timeout_ms: int | None,
        shares: list[int],
        *,
        wait_time_ms: int | None = 0,
        delete_on_receive: bool = False,
    ) -> list[list[ReceivedMessage]]:
        """One receive request: a plain one for one caller, a shared one for several
        (`wait_time_ms` None: the queue's receive wait)."""
        if len(shares) == 1:
            request = queue_pb2.ReceiveMessagesRequest(
                queue=queue, max_messages=shares[0], delete_on_receive=delete_on_receive
            )
            if wait_time_ms is not None:
                request.wait_time_ms = wait_time_ms  # 0 too: "at once", not "as the queue says"
        else:
            request = queue_pb2.ReceiveMessagesRequest(queue=queue, shares=shares, delete_on_receive=delete_on_receive)
        if visibility_timeout_ms is not None:
            request.visibility_timeout_ms = visibility_timeout_ms
        # The deadline leaves room for the server's long poll to end first: without a wait
        # of its own, the longest there is (the queue's may have grown since last heard of).
        timeout = (MAX_WAIT_MS if wait_time_ms is None else wait_time_ms) / 1000 + 30
        routes = await self._routes_for(queue)
        # A receive that deletes is not repeated: the first may have deleted what it took.
        idempotent = not delete_on_receive
        if routes is None:
            response = await self._unary(
                self._stub.ReceiveMessages, request, queue=queue, timeout=timeout, idempotent=idempotent
            )
        else:
            # Each leader serves its own shards first and asks the others when empty:
            # rotating over leaders spreads receivers without starving any shard.
            leaders = sorted(set(routes.leaders) - {""})
            address = leaders[next(self._round_robin) % len(leaders)]
            response = await self._routed(
                queue, address, "ReceiveMessages", request, idempotent=idempotent, timeout=timeout
            )
        self._queue_receive_waits[queue] = response.queue_receive_wait_ms
        received = received_from_proto(response)
        return [received] if len(shares) == 1 else split_shares(response, received, len(shares))

    def _receiver(
        self, queue: str, visibility_timeout_ms: int | None, delete_on_receive: bool = False
    ) -> Coalescer[int, list[ReceivedMessage]]:
        return self._coalescer_for(
            self._receivers,
            (queue, visibility_timeout_ms, delete_on_receive),
            functools.partial(self._receive_now, queue, visibility_timeout_ms, delete_on_receive=delete_on_receive),
            max_batch=MAX_RECEIVE_SHARES,
            max_in_flight=MAX_RECEIVES_IN_FLIGHT,
            # Messages deleted as received cannot be given back; and nothing waits on
            # their deletes, which there are none of (see Companions).
            unwanted=None if delete_on_receive else functools.partial(self._give_back, queue),
            companions_of=None if delete_on_receive else queue,
        )

    def _give_back(self, queue: str, parts: list[list[ReceivedMessage]]) -> None:
        """Messages received for callers that gave up: visible again now, as the server
        makes those of a cancelled receive, not at their visibility timeout. Best effort:
        if this fails, they come back at the timeout anyway."""
        changes = [(message.receipt, 0) for part in parts for message in part]
        if not changes:
            return
        task = asyncio.get_running_loop().create_task(self.change_visibility(queue, changes))
        self._giving_back.add(task)
        task.add_done_callback(self._gave_back)

    def _gave_back(self, task: asyncio.Task[list[EntryResult]]) -> None:
        self._giving_back.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the messages come back at their timeout instead

    async def delete_messages(self, queue: str, receipts: Sequence[str]) -> list[EntryResult]:
        """Delete by receipt; per-receipt results. Concurrent calls to one leader share a
        request, as the AWS SDK's buffered SQS client batches deletes: a lone call goes
        out at once, and calls made while one is in flight go out together once it is
        answered. Four workers each deleting one message at a time sent four requests,
        each a batch of its own on the server; now those made while one is in flight
        share the next (bench/LATENCY.md)."""

        async def call(address: str, chunk: list[str]) -> list[EntryResult]:
            if not chunk or len(chunk) > MAX_ACK_BATCH:  # the server validates and refuses it
                return await self._delete_now(queue, address, chunk)
            return await self._deleter(queue, address).add_many(chunk)

        return await self._by_receipt(queue, receipts, list(receipts), call)

    async def _delete_any_number(self, queue: str, receipts: Sequence[str]) -> list[EntryResult]:
        """A consumer stream's delete(): as delete_messages, but none is answered with nothing
        and more receipts than a request holds go in several (the deleter's batches), as
        the stream's own batching did, where delete_messages has the server refuse both."""

        async def call(address: str, chunk: list[str]) -> list[EntryResult]:
            return await self._deleter(queue, address).add_many(chunk)

        return await self._by_receipt(queue, receipts, list(receipts), call)

    async def _delete_now(self, queue: str, address: str, receipts: list[str]) -> list[EntryResult]:
        request = queue_pb2.DeleteMessagesRequest(queue=queue, receipts=receipts)
        return entry_results_from_proto(
            (await self._routed(queue, address, "DeleteMessages", request, idempotent=False)).results
        )

    async def _delete_on_stream(self, queue: str, address: str, receipts: list[str]) -> list[EntryResult]:
        """One batch of the deleter, on the queue's acknowledgement stream to `address`
        (shardq.ack_streams: answered as the unary call would be, and by it where the
        stream never carried the batch)."""
        return await self._ack_streams.delete(
            queue, address, receipts, functools.partial(self._delete_now, queue, address, receipts)
        )

    async def _open_ack_stream(self, key: tuple[str, str]) -> ConsumerStream:
        queue, address = key
        # No credits: the server pushes nothing on it; max_batch is then never used.
        stream = ConsumerStream(
            self._leader_stub(address),
            queue,
            credits=0,
            visibility_timeout_ms=None,
            max_batch=1,
            # Never called: the deleter sends its batches with acknowledge_deletes.
            delete=functools.partial(self._delete_any_number, queue),
        )
        return await stream.__aenter__()

    def _deleter(self, queue: str, address: str) -> Coalescer[str, EntryResult]:
        return self._coalescer_for(
            self._deleters,
            (queue, address),
            functools.partial(self._delete_on_stream, queue, address),
            max_batch=MAX_ACK_BATCH,
            max_in_flight=MAX_ACKS_IN_FLIGHT,
            companions_of=queue,
        )

    def _companions_of(self, queue: str) -> Companions:
        """The queue's receive and delete batchers: workers receive, then delete each
        message, so a lone call on one waits for the other's batch out (Companions)."""
        companions = self._companions.get(queue)
        if companions is None:
            companions = self._companions[queue] = Companions()
        return companions

    async def change_visibility(self, queue: str, changes: Sequence[tuple[str, int]]) -> list[EntryResult]:
        """Change visibility timeouts by receipt; per-receipt results. Concurrent calls to
        one leader share a request, as deletes do. The server refuses a whole request for
        one invalid timeout; a shared request so refused is sent again call by call, so
        only the caller whose timeout it was gets the error."""
        for position, (_, timeout_ms) in enumerate(changes):
            if not _INT64_MIN <= timeout_ms < _INT64_END:  # the field is named only when needed
                _check_duration(f"changes[{position}].visibility_timeout_ms", timeout_ms)

        async def call(address: str, chunk: list[tuple[str, int]]) -> list[EntryResult]:
            if not chunk or len(chunk) > MAX_RECEIVE_BATCH:  # the server validates and refuses it
                return await self._change_visibility_now(queue, address, chunk)
            return await self._visibility_changer(queue, address).add_many(chunk)

        return await self._by_receipt(queue, [r for r, _ in changes], list(changes), call)

    async def _change_visibility_now(
        self, queue: str, address: str, changes: list[tuple[str, int]]
    ) -> list[EntryResult]:
        request = queue_pb2.ChangeVisibilityRequest(
            queue=queue,
            changes=[queue_pb2.VisibilityChange(receipt=r, visibility_timeout_ms=t) for r, t in changes],
        )
        return entry_results_from_proto(
            (await self._routed(queue, address, "ChangeVisibility", request, idempotent=False)).results
        )

    def _visibility_changer(self, queue: str, address: str) -> Coalescer[tuple[str, int], EntryResult]:
        return self._coalescer_for(
            self._visibility_changers,
            (queue, address),
            functools.partial(self._change_visibility_now, queue, address),
            max_batch=MAX_RECEIVE_BATCH,
            max_in_flight=MAX_ACKS_IN_FLIGHT,
        )

    async def release_messages(
        self, queue: str, receipts: Sequence[str], *, reason: str = "", dead_letter: bool = False
    ) -> list[EntryResult]:
        """Release (nack with backoff); `reason` (at most 1024 characters) is kept as each
        message's last error and carried to its dead-letter copy. `dead_letter`: send them
        to the queue's dead-letter queue now, whatever their receive counts (RabbitMQ's
        reject without requeue), for a message its consumer knows will never succeed; a
        queue without one refuses (InvalidArgument naming `dead_letter`)."""

        async def call(address: str, chunk: list[str]) -> list[EntryResult]:
            request = queue_pb2.ReleaseMessagesRequest(
                queue=queue, receipts=chunk, reason=reason, dead_letter=dead_letter
            )
            return entry_results_from_proto(
                (await self._routed(queue, address, "ReleaseMessages", request, idempotent=False)).results
            )

        return await self._by_receipt(queue, receipts, list(receipts), call)

    async def _by_receipt(
        self,
        queue: str,
        receipts: Sequence[str],
        items: list[Any],
        call: Callable[[str, list[Any]], Awaitable[list[EntryResult]]],
    ) -> list[EntryResult]:
        """Send each receipt's item to the leader of the receipt's shard."""
        routes = await self._routes_for(queue)
        if routes is None or not items:
            return await call("", items)  # the endpoint validates and answers (even an empty batch)
        return await self._per_leader(queue, items, self._addresses_of_receipts(routes, receipts), call)

    def consume(
        self,
        queue: str,
        *,
        credits: int = 400,
        visibility_timeout_ms: int | None = None,
        max_batch: int = MAX_RECEIVE_BATCH,
    ) -> ConsumerStream:
        """A consumer stream; use `async with client.consume(...) as stream`.

        `credits` is the prefetch: how many claimed messages may wait client-side.
        The server claims for the credits it holds and pushes what one claim took
        in frames of up to `max_batch` messages (and 32 MiB). Credits return in
        halves, so a claim usually takes half the credits: gRPC charges per frame
        and the server per claim. The stream drain measured 20k msgs/s with 100
        credits and ~30k with 400 and frames capped at 100 when credits returned in
        quarters (README, Performance), and a few per cent more in halves. Lower
        the credits for slow handlers, whose prefetched messages would otherwise
        wait out their visibility timeout. Leaving the `async with` block gives back
        the messages received and never taken (visible again at once), unless
        `stream.close()` already handed them to the caller.
        """
        return ConsumerStream(
            self._stub,
            queue,
            credits=credits,
            visibility_timeout_ms=visibility_timeout_ms,
            max_batch=max_batch,
            delete=functools.partial(self._delete_any_number, queue),
            give_back=functools.partial(give_back_now, self, queue),
        )

    # -- administration ---------------------------------------------------------------
    async def purge(self, queue: str) -> int:
        response = await self._unary(self._stub.PurgeQueue, queue_pb2.PurgeQueueRequest(queue=queue), queue=queue)
        return int(response.purged)

    async def attributes(self, queue: str) -> QueueAttributes:
        r = await self._unary(
            self._stub.GetQueueAttributes, queue_pb2.GetQueueAttributesRequest(queue=queue), queue=queue
        )
        return QueueAttributes(
            queue=r.queue,
            visible=r.visible,
            in_flight=r.in_flight,
            delayed=r.delayed,
            dead_letter_pending=r.dead_letter_pending,
            oldest_sent_at_ms=r.oldest_sent_at_ms,
            oldest_age_ms=r.oldest_age_ms,
            shards=[
                ShardAttributes(
                    s.shard,
                    s.visible,
                    s.in_flight,
                    s.delayed,
                    s.dead_letter_pending,
                    s.oldest_sent_at_ms,
                    s.commit_index,
                    s.epoch,
                )
                for s in r.shards
            ],
            uncounted_shards=tuple(r.uncounted_shards),
            settings=settings_from_proto(r.config),
        )

    async def describe(self, queue: str) -> list[ShardRoute]:
        r = await self._unary(self._stub.DescribeQueue, queue_pb2.DescribeQueueRequest(queue=queue), queue=queue)
        return [ShardRoute(s.shard, s.leader_address, s.epoch) for s in r.shards]

    async def list_queues(self, prefix: str = "", *, dead_letter_queue: str = "") -> list[str]:
        """Every queue's name, sorted; only those starting with `prefix`, and with a
        `dead_letter_queue`, only those whose dead letters go there (the queues a
        redrive of it would return messages to)."""
        request = queue_pb2.ListQueuesRequest(prefix=prefix, dead_letter_queue=dead_letter_queue)
        response = await self._unary(self._stub.ListQueues, request, queue=dead_letter_queue)
        return list(response.queues)

    async def peek_messages(self, queue: str, *, max_messages: int = 10) -> list[ReceivedMessage]:
        """Look at the messages a receive would hand out now, without claiming them
        (no receipts; receive counts and visibility do not change)."""
        _check_receive_count(max_messages)
        request = queue_pb2.ReceiveMessagesRequest(queue=queue, max_messages=max_messages, peek=True)
        return received_from_proto(await self._unary(self._stub.ReceiveMessages, request, queue=queue))

    async def create_queue(self, queue: str, settings: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Create a queue (settings as for `shardq serve --queue`); returns its settings.
        Creating an existing queue with the same settings is a no-op."""
        request = queue_pb2.CreateQueueRequest(queue=queue, settings=dict(settings or {}))
        description = await self._unary(self._stub.CreateQueue, request, queue=queue, idempotent=True)
        self._forget_routes(queue)
        return settings_from_proto(description.config)

    async def delete_queue(self, queue: str) -> int:
        """Delete a queue and its messages; returns how many it held."""
        request = queue_pb2.DeleteQueueRequest(queue=queue)
        response = await self._unary(self._stub.DeleteQueue, request, queue=queue, idempotent=False)
        self._forget_routes(queue)
        return int(response.messages_deleted)

    async def set_queue_attributes(self, queue: str, settings: Mapping[str, str]) -> dict[str, Any]:
        """Change a queue's settings (not shards, fifo or replicas); returns them all."""
        request = queue_pb2.SetQueueAttributesRequest(queue=queue, settings=dict(settings))
        description = await self._unary(self._stub.SetQueueAttributes, request, queue=queue, idempotent=True)
        return settings_from_proto(description.config)

    async def queue_settings(self, queue: str) -> dict[str, Any]:
        """The queue's settings, as DescribeQueue reports them."""
        request = queue_pb2.DescribeQueueRequest(queue=queue)
        return settings_from_proto((await self._unary(self._stub.DescribeQueue, request, queue=queue)).config)

    async def redrive(
        self, *, source: str, destination: str = "", rate_per_second: float = 0, max_messages: int = 0
    ) -> AsyncIterator[RedriveProgress]:
        """Move the messages of `source` (a dead-letter queue) to `destination`, or without
        one, each back to the queue it was dead-lettered from (among the queues that send
        their dead letters to `source`; the others stay, counted in `kept`)."""
        if not 0 <= max_messages < 2**32:
            # Checked here: the request cannot hold it (protobuf raised a bare ValueError).
            raise InvalidArgument("max_messages", f"must be 0 (all) or a count up to {2**32 - 1}, got {max_messages}")
        request = queue_pb2.RedriveRequest(
            source=source, destination=destination, rate_per_second=rate_per_second, max_messages=max_messages
        )
        try:
            async for progress in self._stub.Redrive(request):
                yield RedriveProgress(progress.moved, progress.remaining, progress.done, progress.kept)
        except grpc.RpcError as error:
            raise error_from_rpc(error, queue=source) from None
