"""The QueueService servicer: unary SQS-style calls plus producer and consumer streams."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc

from shard_server import metrics
from shard_server.domain.client_access import DESCRIBE_VERBS, Verb
from shard_server.domain.validation import (
    resolve_visibility_timeout,
    validate_batch_size,
    validate_receipts,
    validate_receive,
    validate_release_reason,
    validate_shares,
)
from shard_server.runtime import background
from shard_server.runtime.client_access import OPEN_ACCESS, ClientAccess
from shard_server.runtime.committing import wall_clock_ms
from shard_server.runtime.forwarding import FORWARDED_HEADER
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.queue_admin import QueueAdmin
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.service.callers import admit
from shard_server.service.converting import (
    config_to_proto,
    entry_results_to_proto,
    messages_from_proto,
    peeked_to_proto,
    received_frames,
    received_to_proto,
    send_response_to_proto,
    shared_received_to_proto,
)
from shard_server.service.errors import abort_with, stream_error
from shard_server.service.request_reading import RequestReading
from shard_server.service.unwritten import Unwritten
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.errors import InvalidArgument, NotAPeer, Reason, ShardqError
from shardq.queues import MAX_RECEIVE_BATCH, queues_listed

Request = TypeVar("Request")
Response = TypeVar("Response")
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

# Streams: how many producer batches one stream may have read and not yet answered on
# the wire, how many frames a consume stream may (acknowledgements read and messages
# claimed; see unwritten.py), and how long a consumer stream waits in one receive
# before looking at its credits again.
SEND_STREAM_IN_FLIGHT = 256
CONSUME_STREAM_UNWRITTEN = 64
CONSUME_POLL_MS = 1_000
# A consume stream's receive failing for these reasons is a moment of failover (a shard
# led elsewhere now, a claim lost with its leadership): the stream pauses and goes on.
CONSUME_GOES_ON_AFTER = frozenset({Reason.NOT_LEADER, Reason.OUTCOME_UNKNOWN, Reason.UNAVAILABLE})
CONSUME_RETRY_S = 0.05
# How long a queue's counts wait for the other leaders' (asked all at once).
REMOTE_COUNTS_WITHIN_S = 10.0


def _pinned_shard(request: queue_pb2.SendMessagesRequest | queue_pb2.ReceiveMessagesRequest, shards: int) -> int | None:
    if not request.HasField("shard"):
        return None
    if request.shard >= shards:
        raise InvalidArgument("shard", f"the queue has {shards} shards")
    return request.shard


def _visibility_asked(request: queue_pb2.ReceiveMessagesRequest) -> int | None:
    """The request's visibility timeout, None when unset (the queue's then applies)."""
    return request.visibility_timeout_ms if request.HasField("visibility_timeout_ms") else None


def _unsent_receipts(outgoing: asyncio.Queue[queue_pb2.ConsumeResponse | ShardqError | None]) -> list[str]:
    receipts: list[str] = []
    while not outgoing.empty():
        frame = outgoing.get_nowait()
        if isinstance(frame, queue_pb2.ConsumeResponse) and frame.HasField("messages"):
            receipts.extend(message.receipt for message in frame.messages.messages)
    return receipts


def one_per_shard(shards: list[queue_pb2.ShardAttributes]) -> list[queue_pb2.ShardAttributes]:
    """One count per shard: while leadership moves, the old leader and the new one may
    both answer for a shard, and the newer epoch's count is the one that stands."""
    newest: dict[int, queue_pb2.ShardAttributes] = {}
    for attributes in shards:
        known = newest.get(attributes.shard)
        if known is None or attributes.epoch > known.epoch:
            newest[attributes.shard] = attributes
    return list(newest.values())


def _consume_frame() -> tuple[queue_pb2.ConsumeResponse, queue_pb2.ReceiveMessagesResponse]:
    response = queue_pb2.ConsumeResponse()
    return response, response.messages


SEND: tuple[Verb, ...] = (Verb.SEND,)
RECEIVE: tuple[Verb, ...] = (Verb.RECEIVE,)
ADMIN: tuple[Verb, ...] = (Verb.ADMIN,)


def unary(
    method: str,
    verbs: tuple[Verb, ...],
) -> Callable[
    [Callable[[Any, Request, Context], Awaitable[Response]]], Callable[[Any, Request, Context], Awaitable[Response]]
]:
    """Time the call, admit its caller to one of `verbs` on the request's queue when the
    server authenticates clients (before the handler looks the queue up, so a caller
    without rights learns nothing of it), and turn a ShardqError into a status with
    ErrorInfo."""
    histogram = metrics.REQUEST_SECONDS.labels(method)

    def decorate(
        handler: Callable[[Any, Request, Context], Awaitable[Response]],
    ) -> Callable[[Any, Request, Context], Awaitable[Response]]:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Request, context: Context) -> Response:
            started = time.perf_counter()
            try:
                if self.access.enforced:
                    await self._authorized(context, verbs, getattr(request, "queue", ""))
                return await handler(self, request, context)
            except ShardqError as error:
                await abort_with(context, error)
                raise  # unreachable: abort raises
            finally:
                histogram.observe(time.perf_counter() - started)

        return wrapper

    return decorate


# The streams' names in shardq_stream_requests_total, as RPCs are named in shardq_requests_total.
SEND_STREAM = "QueueService/SendStream"
CONSUME_STREAM = "QueueService/ConsumeStream"


class QueueServicer(queue_pb2_grpc.QueueServiceServicer):
    def __init__(
        self,
        host: QueueHost,
        admin: QueueAdmin,
        *,
        credential: PeerCredential = NO_PEER_SECRET,
        access: ClientAccess = OPEN_ACCESS,
    ) -> None:
        self.host = host
        self.admin = admin
        self.credential = credential
        self.access = access
        # Exported at 0 from the start: a counter series that first appears already counting
        # shows rate() no increase, and a server's stream requests come in its first seconds.
        for stream in (SEND_STREAM, CONSUME_STREAM):
            metrics.STREAM_REQUESTS.labels(stream, "OK")
        # Per open producer stream, and consume stream never granted credits: stops reading
        # it, so that it ends once it has answered what it read (end_request_streams).
        self._request_streams: set[Callable[[], None]] = set()

    def _forwarded(self, context: Context) -> bool:
        """Whether another server forwarded this call: it is then not forwarded again, and
        its sends may set reserved attributes (a dead letter moved to a DLQ led elsewhere).
        A call marked so without the cluster's peer secret is refused."""
        metadata = context.invocation_metadata() or ()
        if not any(key == FORWARDED_HEADER for key, _ in metadata):
            return False
        if not self.credential.admits(metadata):
            raise NotAPeer(f"a call marked {FORWARDED_HEADER!r} is taken only from the cluster's servers (peer secret)")
        return True

    async def _authorized(self, context: Context, verbs: tuple[Verb, ...], queue: str) -> None:
        """Raises unless the caller may do one of `verbs` to `queue` (callers.admit);
        called only when the server authenticates its clients, before the queue is looked
        up, so that a caller without rights learns nothing of it."""
        await admit(self.access, self.credential, context.invocation_metadata(), verbs, queue)

    def end_request_streams(self) -> None:
        """The server is shutting down: end every producer stream, and every consume
        stream that only carries acknowledgements (never granted credits), once it has
        answered the requests it read. Such a stream has nothing of its own to finish,
        and clients keep one open for as long as they live (AsyncClient sends its sends
        and deletes on them), so a graceful stop would otherwise wait out its whole grace
        period for them. Their clients learn from SHUTTING_DOWN that what went unanswered
        was never read, and send it elsewhere."""
        for end in list(self._request_streams):
            end()

    async def _send(
        self, request: queue_pb2.SendMessagesRequest, *, forwarded: bool = False
    ) -> queue_pb2.SendMessagesResponse:
        queue = self.host.get(request.queue)
        shard = _pinned_shard(request, queue.config.shards)
        messages = messages_from_proto(queue.config, request.messages, forwarded=forwarded)
        entries = await queue.send(messages, shard=shard, forwarded=forwarded)
        return send_response_to_proto(entries)

    @unary("SendMessages", SEND)
    async def SendMessages(
        self, request: queue_pb2.SendMessagesRequest, context: Context
    ) -> queue_pb2.SendMessagesResponse:
        return await self._send(request, forwarded=self._forwarded(context))

    @unary("ReceiveMessages", RECEIVE)
    async def ReceiveMessages(
        self, request: queue_pb2.ReceiveMessagesRequest, context: Context
    ) -> queue_pb2.ReceiveMessagesResponse:
        queue = self.host.get(request.queue)
        if request.shares:
            response = await self._receive_shares(queue, request, context)
            response.queue_receive_wait_ms = queue.config.receive_wait_ms
            return response
        # A receive that does not say how long to wait waits as its queue says (a
        # peek never waits); one forwarded here always says.
        asked_wait = request.HasField("wait_time_ms") or request.peek
        wait_ms = request.wait_time_ms if asked_wait else queue.config.receive_wait_ms
        visibility = validate_receive(
            queue.config,
            max_messages=request.max_messages,
            visibility_timeout_ms=_visibility_asked(request),
            wait_ms=wait_ms,
        )
        if request.peek:
            if request.wait_time_ms:
                # Once taken and ignored: a caller believed its peek long-polled.
                raise InvalidArgument("wait_time_ms", "a peek answers at once and does not wait: give 0")
            if request.delete_on_receive:
                raise InvalidArgument("delete_on_receive", "a peek changes nothing: it cannot delete")
            peeked = await queue.peek(
                max_messages=request.max_messages,
                shard=_pinned_shard(request, queue.config.shards),
                forwarded=self._forwarded(context),
            )
            return peeked_to_proto(peeked, max_messages=request.max_messages)
        received = await queue.receive(
            max_messages=request.max_messages,
            visibility_timeout_ms=visibility,
            wait_ms=wait_ms,
            shard=_pinned_shard(request, queue.config.shards),
            forwarded=self._forwarded(context),
            delete_on_receive=request.delete_on_receive,
        )
        response = received_to_proto(received, deleted=request.delete_on_receive)
        # Read now, not before the wait: a change of the setting meanwhile is news to the client.
        response.queue_receive_wait_ms = queue.config.receive_wait_ms
        return response

    async def _receive_shares(
        self, queue: HostedQueue, request: queue_pb2.ReceiveMessagesRequest, context: Context
    ) -> queue_pb2.ReceiveMessagesResponse:
        """Several receivers' short polls in one request (shardq.receive_shares)."""
        shares = list(request.shares)
        validate_shares(shares, max_messages=request.max_messages, wait_ms=request.wait_time_ms, peek=request.peek)
        visibility = resolve_visibility_timeout(queue.config, "visibility_timeout_ms", _visibility_asked(request))
        parts = await queue.receive_shares(
            shares,
            visibility_timeout_ms=visibility,
            shard=_pinned_shard(request, queue.config.shards),
            forwarded=self._forwarded(context),
            delete_on_receive=request.delete_on_receive,
        )
        return shared_received_to_proto(parts, deleted=request.delete_on_receive)

    @unary("DeleteMessages", RECEIVE)
    async def DeleteMessages(
        self, request: queue_pb2.DeleteMessagesRequest, context: Context
    ) -> queue_pb2.DeleteMessagesResponse:
        queue = self.host.get(request.queue)
        validate_receipts("receipts", request.receipts)
        outcomes = await queue.delete(list(request.receipts), forwarded=self._forwarded(context))
        return queue_pb2.DeleteMessagesResponse(results=entry_results_to_proto(outcomes))

    @unary("ChangeVisibility", RECEIVE)
    async def ChangeVisibility(
        self, request: queue_pb2.ChangeVisibilityRequest, context: Context
    ) -> queue_pb2.ChangeVisibilityResponse:
        queue = self.host.get(request.queue)
        validate_batch_size("changes", len(request.changes), MAX_RECEIVE_BATCH)
        changes = [
            (
                change.receipt,
                resolve_visibility_timeout(
                    queue.config, f"changes[{index}].visibility_timeout_ms", change.visibility_timeout_ms
                ),
            )
            for index, change in enumerate(request.changes)
        ]
        outcomes = await queue.change_visibility(changes, forwarded=self._forwarded(context))
        return queue_pb2.ChangeVisibilityResponse(results=entry_results_to_proto(outcomes))

    @unary("ReleaseMessages", RECEIVE)
    async def ReleaseMessages(
        self, request: queue_pb2.ReleaseMessagesRequest, context: Context
    ) -> queue_pb2.ReleaseMessagesResponse:
        queue = self.host.get(request.queue)
        validate_receipts("receipts", request.receipts)
        validate_release_reason("reason", request.reason)
        forwarded = self._forwarded(context)
        if request.dead_letter:
            outcomes = await queue.dead_letter(list(request.receipts), reason=request.reason, forwarded=forwarded)
        else:
            outcomes = await queue.release(list(request.receipts), reason=request.reason, forwarded=forwarded)
        return queue_pb2.ReleaseMessagesResponse(results=entry_results_to_proto(outcomes))

    @unary("PurgeQueue", ADMIN)
    async def PurgeQueue(self, request: queue_pb2.PurgeQueueRequest, context: Context) -> queue_pb2.PurgeQueueResponse:
        queue = self.host.get(request.queue)
        return queue_pb2.PurgeQueueResponse(purged=await queue.purge(forwarded=self._forwarded(context)))

    @unary("GetQueueAttributes", (Verb.GET,))
    async def GetQueueAttributes(
        self, request: queue_pb2.GetQueueAttributesRequest, context: Context
    ) -> queue_pb2.QueueAttributes:
        return await self._attributes(self.host.get(request.queue), forwarded=self._forwarded(context))

    async def _attributes(self, queue: HostedQueue, *, forwarded: bool) -> queue_pb2.QueueAttributes:
        """The queue's counts: its shards led here, and (unless this call was forwarded)
        the other shards' from their leaders."""
        # Counting scans the index past `now`: keep it off the event loop.
        # One pass picks the led shards and reads them, so leadership moving in
        # between cannot pair a shard with another's counts.
        await queue.until_committed()
        stats = await asyncio.to_thread(queue.stats)
        shards = [
            queue_pb2.ShardAttributes(
                shard=shard.index,
                visible=s.visible,
                in_flight=s.in_flight,
                delayed=s.delayed,
                dead_letter_pending=s.dead_letter_pending,
                oldest_sent_at_ms=s.oldest_sent_at_ms,
                commit_index=s.last_index,
                epoch=shard.epoch,
            )
            for shard, s in stats
        ]
        uncounted: list[int] = []
        if not forwarded and queue.router is not None:
            calls = queue.router.calls

            async def counted_by(leader: str) -> list[queue_pb2.ShardAttributes]:
                try:
                    remote = await calls.queue_attributes(leader, queue.config.name, timeout_s=REMOTE_COUNTS_WITHIN_S)
                except ShardqError:
                    return []  # its shards are named in uncounted_shards below
                return list(remote.shards)

            # All leaders at once: a hung one costs the call one deadline, not one each.
            for remote_shards in await asyncio.gather(*(counted_by(leader) for leader in queue.remote_leaders())):
                shards.extend(remote_shards)
            shards = one_per_shard(shards)
            # Shards with no answer, or no known leader: the caller is told, not handed
            # totals that silently read as fewer messages.
            counted = {a.shard for a in shards}
            uncounted = [index for index in range(queue.config.shards) if index not in counted]
        shards.sort(key=lambda a: a.shard)
        oldest = min((a.oldest_sent_at_ms for a in shards if a.oldest_sent_at_ms), default=0)
        return queue_pb2.QueueAttributes(
            queue=queue.config.name,
            visible=sum(a.visible for a in shards),
            in_flight=sum(a.in_flight for a in shards),
            delayed=sum(a.delayed for a in shards),
            dead_letter_pending=sum(a.dead_letter_pending for a in shards),
            oldest_sent_at_ms=oldest,
            oldest_age_ms=max(wall_clock_ms() - oldest, 0) if oldest else 0,
            shards=shards,
            config=config_to_proto(queue.config),
            uncounted_shards=uncounted,
        )

    @unary("DescribeQueue", DESCRIBE_VERBS)
    async def DescribeQueue(
        self, request: queue_pb2.DescribeQueueRequest, context: Context
    ) -> queue_pb2.QueueDescription:
        queue = self.host.get(request.queue)
        return queue_pb2.QueueDescription(
            config=config_to_proto(queue.config),
            shards=[
                queue_pb2.ShardRoute(shard=index, leader_address=address, epoch=epoch)
                for index, address, epoch in self.host.routes(queue)
            ],
        )

    def _description(self, queue: HostedQueue) -> queue_pb2.QueueDescription:
        return queue_pb2.QueueDescription(
            config=config_to_proto(queue.config),
            shards=[
                queue_pb2.ShardRoute(shard=index, leader_address=address, epoch=epoch)
                for index, address, epoch in self.host.routes(queue)
            ],
        )

    @unary("CreateQueue", ADMIN)
    async def CreateQueue(self, request: queue_pb2.CreateQueueRequest, context: Context) -> queue_pb2.QueueDescription:
        queue, _ = await self.admin.create(request.queue, dict(request.settings))
        return self._description(queue)

    @unary("DeleteQueue", ADMIN)
    async def DeleteQueue(
        self, request: queue_pb2.DeleteQueueRequest, context: Context
    ) -> queue_pb2.DeleteQueueResponse:
        queue = self.host.get(request.queue)
        if queue.router is None:
            return queue_pb2.DeleteQueueResponse(messages_deleted=await self.admin.delete(request.queue))
        # In a cluster this server holds some shards (or none): count on every leader first.
        held = await self._attributes(queue, forwarded=False)
        await self.admin.delete(request.queue)
        return queue_pb2.DeleteQueueResponse(messages_deleted=held.visible + held.in_flight + held.delayed)

    @unary("SetQueueAttributes", ADMIN)
    async def SetQueueAttributes(
        self, request: queue_pb2.SetQueueAttributesRequest, context: Context
    ) -> queue_pb2.QueueDescription:
        return self._description(await self.admin.set_attributes(request.queue, dict(request.settings)))

    @unary("ListQueues", (Verb.LIST,))
    async def ListQueues(self, request: queue_pb2.ListQueuesRequest, context: Context) -> queue_pb2.ListQueuesResponse:
        targets = {name: queue.config.dead_letter_queue for name, queue in list(self.host.queues.items())}
        return queue_pb2.ListQueuesResponse(
            queues=queues_listed(targets, prefix=request.prefix, dead_letter_queue=request.dead_letter_queue)
        )

    async def Redrive(
        self, request: queue_pb2.RedriveRequest, context: Context
    ) -> AsyncIterator[queue_pb2.RedriveProgress]:
        try:
            if self.access.enforced:
                await self._authorized(context, ADMIN, request.source)
            # Asked before the redrive, so that each queue moved to is one authorized here
            # (without a destination: every queue that sends its dead letters to the source).
            destinations = background.redrive_destinations(self.host, request.source, request.destination)
            if self.access.enforced:
                for name in sorted(destinations):
                    await self._authorized(context, ADMIN, name)
            async for progress in background.redrive(
                self.host,
                source=request.source,
                destination=request.destination,
                rate_per_second=request.rate_per_second,
                max_messages=request.max_messages,
                destinations=destinations,
            ):
                yield queue_pb2.RedriveProgress(
                    moved=progress.moved, remaining=progress.remaining, done=progress.done, kept=progress.kept
                )
        except ShardqError as error:
            await abort_with(context, error)

    async def SendStream(
        self, request_iterator: AsyncIterator[queue_pb2.SendStreamRequest], context: Context
    ) -> AsyncIterator[queue_pb2.SendStreamResponse]:
        histogram = metrics.REQUEST_SECONDS.labels("SendStream")
        sent = metrics.STREAM_REQUESTS.labels(SEND_STREAM, "OK")
        # Answers; None when the client's side ended, an error when the stream must end with it.
        answers: asyncio.Queue[queue_pb2.SendStreamResponse | ShardqError | None] = asyncio.Queue()
        unwritten = Unwritten(SEND_STREAM_IN_FLIGHT)
        pending: set[asyncio.Task[None]] = set()
        metadata = context.invocation_metadata()

        async def answer(request: queue_pb2.SendStreamRequest) -> None:
            started = time.perf_counter()
            try:
                # Per batch: one stream carries a client's sends to every queue.
                if self.access.enforced:
                    await admit(self.access, self.credential, metadata, SEND, request.batch.queue)
                response = await self._send(request.batch)
                answers.put_nowait(queue_pb2.SendStreamResponse(request_id=request.request_id, response=response))
                sent.inc()
            except ShardqError as error:
                refusal = stream_error(error)
                answers.put_nowait(queue_pb2.SendStreamResponse(request_id=request.request_id, error=refusal))
                metrics.STREAM_REQUESTS.labels(SEND_STREAM, refusal.code).inc()
            finally:
                histogram.observe(time.perf_counter() - started)

        async def take(request: queue_pb2.SendStreamRequest) -> None:
            await unwritten.room()
            unwritten.add()
            task = asyncio.create_task(answer(request))
            pending.add(task)
            task.add_done_callback(pending.discard)

        reading = RequestReading(request_iterator, context, take, pending, answers.put_nowait)
        reader = reading.task
        stop_reading = reading.stop
        self._request_streams.add(stop_reading)
        try:
            while (response := await answers.get()) is not None:
                if isinstance(response, ShardqError):
                    await abort_with(context, response)
                    return
                yield response  # resumed once written (gRPC's flow control allowing)
                unwritten.written()
        finally:
            self._request_streams.discard(stop_reading)
            reader.cancel()
            for task in list(pending):
                task.cancel()

    async def ConsumeStream(
        self, request_iterator: AsyncIterator[queue_pb2.ConsumeRequest], context: Context
    ) -> AsyncIterator[queue_pb2.ConsumeResponse]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        try:
            if first.WhichOneof("kind") != "start":
                raise InvalidArgument("start", "the first message of a consume stream must be start")
            if self.access.enforced:
                await self._authorized(context, RECEIVE, first.start.queue)
            queue = self.host.get(first.start.queue)
            visibility = resolve_visibility_timeout(
                queue.config,
                "start.visibility_timeout_ms",
                first.start.visibility_timeout_ms if first.start.HasField("visibility_timeout_ms") else None,
            )
            max_batch = first.start.max_batch or 10
            if not 1 <= max_batch <= MAX_RECEIVE_BATCH:
                raise InvalidArgument("start.max_batch", f"must be 1..{MAX_RECEIVE_BATCH}")
        except ShardqError as error:
            await abort_with(context, error)
            return

        acknowledged = metrics.STREAM_REQUESTS.labels(CONSUME_STREAM, "OK")
        # Responses; None when the client's side ended, an error when the stream must end with it.
        outgoing: asyncio.Queue[queue_pb2.ConsumeResponse | ShardqError | None] = asyncio.Queue()
        credits = 0
        credit_granted = asyncio.Event()
        acks: set[asyncio.Task[None]] = set()
        unwritten = Unwritten(CONSUME_STREAM_UNWRITTEN)

        async def acknowledge(ack: queue_pb2.Acknowledge) -> None:
            try:
                # As DeleteMessages and ReleaseMessages bound theirs: one frame of
                # millions of receipts once held the event loop for seconds and grew
                # the server by gigabytes. Refused whole, without a result per receipt.
                if ack.receipts:
                    validate_receipts("ack.receipts", ack.receipts)
                if ack.release:
                    validate_receipts("ack.release", ack.release)
                if ack.dead_letter:
                    validate_receipts("ack.dead_letter", ack.dead_letter)
                    # Before anything is acted on: a refusal after the deletes would read
                    # as though they had failed too.
                    self.host.get(queue.config.name).check_dead_letter_queue("ack.dead_letter")
            except ShardqError as error:
                refusal = stream_error(error)
                outgoing.put_nowait(
                    queue_pb2.ConsumeResponse(ack=queue_pb2.AckResult(ack_id=ack.ack_id, failed=refusal))
                )
                metrics.STREAM_REQUESTS.labels(CONSUME_STREAM, refusal.code).inc()
                return
            try:
                if ack.release or ack.dead_letter:
                    validate_release_reason("ack.release_reason", ack.release_reason)
                # The queue of that name now, as a DeleteMessages call finds it: deleted
                # since the stream started, acknowledging raises QUEUE_NOT_FOUND, as that
                # call would (the deleted queue's shards would refuse as shutting down).
                current = self.host.get(queue.config.name)
                deleted = await current.delete(list(ack.receipts)) if ack.receipts else []
                released = await current.release(list(ack.release), reason=ack.release_reason) if ack.release else []
                dead = (
                    await current.dead_letter(list(ack.dead_letter), reason=ack.release_reason)
                    if ack.dead_letter
                    else []
                )
                result = queue_pb2.AckResult(
                    ack_id=ack.ack_id,
                    deleted=entry_results_to_proto(deleted),
                    released=entry_results_to_proto(released),
                    dead_lettered=entry_results_to_proto(dead),
                )
                acknowledged.inc()
            except ShardqError as error:
                # The whole acknowledgement failed (e.g. leadership lost before it was
                # replicated: OUTCOME_UNKNOWN). Answer it anyway, per receipt: a client
                # waiting for this ack_id would otherwise wait forever.
                failed = queue_pb2.EntryResult(
                    ok=False, error=queue_pb2.EntryError(reason=error.reason.value, message=error.message)
                )
                refusal = stream_error(error)
                result = queue_pb2.AckResult(
                    ack_id=ack.ack_id,
                    deleted=[failed] * len(ack.receipts),
                    released=[failed] * len(ack.release),
                    dead_lettered=[failed] * len(ack.dead_letter),
                    failed=refusal,
                )
                metrics.STREAM_REQUESTS.labels(CONSUME_STREAM, refusal.code).inc()
            outgoing.put_nowait(queue_pb2.ConsumeResponse(ack=result))

        granted = False

        async def take(request: queue_pb2.ConsumeRequest) -> None:
            nonlocal credits, granted
            kind = request.WhichOneof("kind")
            if kind == "credits":
                credits += request.credits
                granted = granted or request.credits > 0
                credit_granted.set()
            elif kind == "ack":
                await unwritten.room()
                unwritten.add()
                task = asyncio.create_task(acknowledge(request.ack))
                acks.add(task)
                task.add_done_callback(acks.discard)
            else:
                # Once ignored: a client that sent a second start believed it had changed
                # the stream's queue or settings.
                outgoing.put_nowait(
                    InvalidArgument("kind", "after its start, a consume stream takes only credits and acks")
                )

        async def push_messages() -> None:
            nonlocal credits
            while True:
                if credits <= 0:
                    credit_granted.clear()
                    await credit_granted.wait()
                    continue
                # Claim no more while the client has not read what was pushed: credits
                # granted without reading would otherwise pile claimed messages up here.
                await unwritten.room()
                # Claim for every credit at once (one commit round trip) and push
                # in frames of max_batch: round trips, not frames, bound the rate.
                # (Cancelled as the stream ends, a receive gives back what it claimed.)
                try:
                    received = await queue.receive(
                        max_messages=min(credits, MAX_RECEIVE_BATCH),
                        visibility_timeout_ms=visibility,
                        wait_ms=CONSUME_POLL_MS,
                    )
                except ShardqError as error:
                    # Before, the pusher died here and the stream stayed open pushing
                    # nothing: its consumer waited forever (found by the demo's failover).
                    if error.reason not in CONSUME_GOES_ON_AFTER:
                        outgoing.put_nowait(error)
                        return
                    await asyncio.sleep(CONSUME_RETRY_S)
                    continue
                credits -= len(received)
                for frame in received_frames(received, max_batch, _consume_frame):
                    unwritten.add()
                    outgoing.put_nowait(frame)

        reading = RequestReading(request_iterator, context, take, acks, outgoing.put_nowait)
        reader = reading.task
        pusher = asyncio.create_task(push_messages())

        def end_if_only_acknowledging() -> None:
            # A consumer's stream has messages of its own to finish: left to the grace period.
            if not granted:
                reading.stop()

        self._request_streams.add(end_if_only_acknowledging)
        try:
            while (response := await outgoing.get()) is not None:
                if isinstance(response, ShardqError):
                    await abort_with(context, response)
                    return
                yield response  # resumed once written (gRPC's flow control allowing)
                unwritten.written()
        finally:
            self._request_streams.discard(end_if_only_acknowledging)
            pusher.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pusher
            # Claimed here but never sent: visible again now, not at their timeout.
            unsent = _unsent_receipts(outgoing)
            if unsent:
                handover = asyncio.create_task(queue.change_visibility([(receipt, 0) for receipt in unsent]))
                with contextlib.suppress(asyncio.CancelledError, ShardqError):
                    await asyncio.shield(handover)
