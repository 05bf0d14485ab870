"""Routing requests to shard leaders on other servers of the cluster.

Any server accepts any request: what it cannot serve itself it forwards to the
shard's leader, marking the call as forwarded so the leader never forwards it
again (a stale view then ends in NOT_LEADER instead of a loop). `Router` knows who
leads what (from the leases); `LeaderCalls` is the only code that calls a leader.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol

import grpc

from shard_server.domain.messages import NewMessage
from shard_server.domain.sending import SendOutcome
from shard_server.runtime.serving_tls import say_if_peer_tls_failed
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.channel_options import RESOLVE_AGAIN_WITHIN_HALF_A_SECOND
from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.leases import LeaseStore
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.coordination.placement import ShardId
from shardq.errors import Reason, ShardqError, Unavailable
from shardq.receive_shares import split_shares
from shardq.status import answered_by_shardq, build_error, error_from_rpc, never_sent, unknown_if_sent
from shardq.tls import ClientTls, aio_channel

log = logging.getLogger(__name__)

FORWARDED_HEADER = "shardq-forwarded"
FORWARDED = ((FORWARDED_HEADER, "1"),)
ROUTE_REFRESH_S = 0.2
# A short poll of another leader, asked because this server's own shards were empty,
# answers in milliseconds when that leader runs. A hung one (a frozen pod, a cut
# network) is given up on after this, and skipped by the next such polls for
# UNANSWERED_LEADER_SKIPPED_S: each hung leader once cost every receive 10 s, in turn.
REMOTE_SHORT_POLL_S = 2.0
UNANSWERED_LEADER_SKIPPED_S = 5.0
# How long the other leaders have to purge their shards (all asked at once). Under the
# client's default deadline (30 s), so that with a hung leader the caller still hears
# which shards were purged and which were not, rather than DEADLINE_EXCEEDED alone.
REMOTE_PURGE_WITHIN_S = 20.0
# What a shard's leader answers, or what asking it raises, while it is away or being
# replaced: the shard is named as not done, to be tried again. Anything else (the
# queue deleted, a refused request) is the caller's answer as it stands.
LEADER_AWAY_REASONS = frozenset({Reason.NOT_LEADER, Reason.UNAVAILABLE, Reason.OUTCOME_UNKNOWN, Reason.SHUTTING_DOWN})
# Peers restart and fail over within seconds: reconnect quickly rather than
# with gRPC's default backoff, which grows to two minutes.
PEER_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    RESOLVE_AGAIN_WITHIN_HALF_A_SECOND,
]


class LeaderUnreachable(Unavailable):
    """A call that never reached the leader (it refused the connection, or its name did
    not resolve): nothing was applied, so receipts may go to whoever leads now, and a send
    may be made again."""


class Router:
    def __init__(
        self,
        cluster: ClusterMap,
        leases: LeaseStore,
        *,
        server_id: str,
        credential: PeerCredential = NO_PEER_SECRET,
        tls: ClientTls | None = None,
    ) -> None:
        self.cluster = cluster
        self.server_id = server_id
        # How other leaders are reached: over TLS when the servers serve it.
        self.tls = tls
        # What every call to another leader carries: the forwarded mark and the peer secret.
        self.forwarded_metadata = FORWARDED + credential.metadata
        self._leases = leases
        self._stubs: dict[str, queue_pb2_grpc.QueueServiceAsyncStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        # (queue, shard) -> (leader server id, epoch)
        self.routes: dict[tuple[str, int], tuple[str, int]] = {}
        self.calls = LeaderCalls(self)
        # Leaders whose short poll went unanswered, and until when (monotonic) they are skipped.
        self._unanswered_until: dict[str, float] = {}

    def note_unanswered(self, leader: str) -> None:
        self._unanswered_until[leader] = time.monotonic() + UNANSWERED_LEADER_SKIPPED_S

    def note_answered(self, leader: str) -> None:
        self._unanswered_until.pop(leader, None)

    def answering(self, leaders: Sequence[str]) -> list[str]:
        """`leaders` without those skipped for not answering a short poll lately: for the
        calls that only look for work elsewhere. Calls whose answer must be whole (counts
        for a redrive, a purge) and calls for one shard still ask every leader."""
        now = time.monotonic()
        return [leader for leader in leaders if self._unanswered_until.get(leader, 0.0) <= now]

    def leader_of(self, queue: str, shard: int) -> tuple[str, int]:
        return self.routes.get((queue, shard), ("", 0))

    def address_of(self, server_id: str) -> str:
        return self.cluster.address_of(server_id)

    def stub_for(self, server_id: str) -> queue_pb2_grpc.QueueServiceAsyncStub:
        stub = self._stubs.get(server_id)
        if stub is None:
            server = self.cluster.servers.get(server_id)
            if server is None:  # a lease names a server the map no longer lists (scaled in)
                raise Unavailable(f"server {server_id!r} leads the shard but is not in the cluster map")
            channel = aio_channel(server.address, self.tls, PEER_CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[server_id] = queue_pb2_grpc.QueueServiceStub(channel)
        return stub

    def refresh(self) -> None:
        routes = {}
        for config in self.cluster.queue_configs():
            for shard in range(config.shards):
                lease = self._leases.get(lease_name(ShardId(config.name, shard)))
                if lease is not None and lease.holder:
                    routes[(config.name, shard)] = (lease.holder, lease.transitions)
        self.routes = routes

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:
                log.exception("refreshing shard routes failed")
            await asyncio.sleep(ROUTE_REFRESH_S)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class _EntryResults(Protocol):
    """The answer of every batch call on receipts."""

    @property
    def results(self) -> Sequence[queue_pb2.EntryResult]: ...


class LeaderCalls:
    """Every call this server makes to another shard's leader on a client's behalf.

    The one place that speaks the client protocol to peers: requests are built here,
    marked as forwarded (the leader never forwards them again), and answers and gRPC
    failures come back as the runtime's own values and errors.
    """

    def __init__(self, router: Router) -> None:
        self._router = router
        self._marked = router.forwarded_metadata

    def _stub(self, leader: str) -> queue_pb2_grpc.QueueServiceAsyncStub:
        return self._router.stub_for(leader)

    async def send_messages(
        self, leader: str, queue: str, shard: int, batch: Sequence[NewMessage]
    ) -> list[SendOutcome]:
        request = queue_pb2.SendMessagesRequest(
            queue=queue,
            shard=shard,
            messages=[
                queue_pb2.MessageToSend(
                    body=m.body,
                    attributes=m.attributes,
                    group_id=m.group_id,
                    dedup_id=m.dedup_id,
                    delay_ms=m.delay_ms,
                    priority=m.priority,
                )
                for m in batch
            ],
        )
        try:
            response = await self._stub(leader).SendMessages(request, metadata=self._marked, timeout=30)
        except grpc.RpcError as error:
            # Cut off after it was sent, the leader may have stored the batch: UNAVAILABLE
            # ("nothing stored") let a caller that resends on it store it twice.
            raise forward_failure(error, queue=queue, what="the send forwarded to the shard's leader failed") from None
        return [
            SendOutcome(
                r.message_id,
                r.seq,
                r.shard,
                r.duplicate,
                build_error(reason=r.error.reason, message=r.error.message) if r.error.reason else None,
            )
            for r in response.results
        ]

    async def receive_messages(
        self,
        leader: str,
        queue: str,
        *,
        max_messages: int,
        visibility_timeout_ms: int = 0,
        wait_ms: int = 0,
        shard: int | None = None,
        peek: bool = False,
        delete_on_receive: bool = False,
    ) -> list[queue_pb2.ReceivedMessage]:
        """Messages the leader claimed (or, with `peek`, showed; with `delete_on_receive`,
        deleted) for this call; they pass through to the client as the leader encoded them."""
        request = queue_pb2.ReceiveMessagesRequest(
            queue=queue,
            max_messages=max_messages,
            visibility_timeout_ms=visibility_timeout_ms,
            wait_time_ms=wait_ms,
            peek=peek,
            delete_on_receive=delete_on_receive,
        )
        if shard is not None:
            request.shard = shard
        timeout = wait_ms / 1000 + 10 if wait_ms else REMOTE_SHORT_POLL_S
        response = await self._receive(leader, queue, request, timeout=timeout)
        return list(response.messages)

    async def receive_shares(
        self,
        leader: str,
        queue: str,
        shares: Sequence[int],
        *,
        visibility_timeout_ms: int,
        shard: int | None,
        delete_on_receive: bool = False,
    ) -> list[list[queue_pb2.ReceivedMessage]]:
        """What the leader claimed (and, with `delete_on_receive`, deleted) for each share
        of a shared short poll, in order."""
        request = queue_pb2.ReceiveMessagesRequest(
            queue=queue, shares=shares, visibility_timeout_ms=visibility_timeout_ms, delete_on_receive=delete_on_receive
        )
        if shard is not None:
            request.shard = shard
        response = await self._receive(leader, queue, request, timeout=REMOTE_SHORT_POLL_S)
        return split_shares(response, response.messages, len(shares))

    async def _receive(
        self, leader: str, queue: str, request: queue_pb2.ReceiveMessagesRequest, *, timeout: float
    ) -> queue_pb2.ReceiveMessagesResponse:
        try:
            response = await self._stub(leader).ReceiveMessages(request, metadata=self._marked, timeout=timeout)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                self._router.note_unanswered(leader)
            if request.delete_on_receive:
                # Sent, then cut off or out of time: the leader may have deleted what it
                # received for the call, and those messages are handed out no more.
                what = "the receive forwarded to the shard's leader failed"
                raise forward_failure(error, queue=queue, what=what) from None
            raise error_from_rpc(error, queue=queue) from None
        self._router.note_answered(leader)
        return response

    async def delete_messages(self, leader: str, queue: str, receipts: Sequence[str]) -> list[Reason | None]:
        request = queue_pb2.DeleteMessagesRequest(queue=queue, receipts=receipts)
        return await self._entries(queue, self._stub(leader).DeleteMessages(request, metadata=self._marked, timeout=30))

    async def release_messages(
        self, leader: str, queue: str, receipts: Sequence[str], *, reason: str, dead_letter: bool = False
    ) -> list[Reason | None]:
        request = queue_pb2.ReleaseMessagesRequest(
            queue=queue, receipts=receipts, reason=reason, dead_letter=dead_letter
        )
        call = self._stub(leader).ReleaseMessages(request, metadata=self._marked, timeout=30)
        return await self._entries(queue, call)

    async def change_visibility(
        self, leader: str, queue: str, changes: Sequence[tuple[str, int]]
    ) -> list[Reason | None]:
        request = queue_pb2.ChangeVisibilityRequest(
            queue=queue,
            changes=[queue_pb2.VisibilityChange(receipt=receipt, visibility_timeout_ms=ms) for receipt, ms in changes],
        )
        call = self._stub(leader).ChangeVisibility(request, metadata=self._marked, timeout=30)
        return await self._entries(queue, call)

    async def _entries(self, queue: str, call: Awaitable[_EntryResults]) -> list[Reason | None]:
        try:
            response = await call
        except grpc.RpcError as error:
            # Sent, then cut off or out of time: the leader may have applied it, which
            # UNAVAILABLE passed on per receipt would deny (a client may then act again).
            raise forward_failure(error, queue=queue, what="the call forwarded to the shard's leader failed") from None
        return [None if r.ok else Reason(r.error.reason) for r in response.results]

    async def purge(self, leader: str, queue: str) -> int:
        request = queue_pb2.PurgeQueueRequest(queue=queue)
        try:
            purge = self._stub(leader).PurgeQueue(request, metadata=self._marked, timeout=REMOTE_PURGE_WITHIN_S)
            response = await purge
        except grpc.RpcError as error:
            raise error_from_rpc(error, queue=queue) from None
        return response.purged

    async def queue_attributes(self, leader: str, queue: str, *, timeout_s: float) -> queue_pb2.QueueAttributes:
        """The counts of the shards `leader` leads (ShardqError if it does not answer)."""
        request = queue_pb2.GetQueueAttributesRequest(queue=queue)
        try:
            return await self._stub(leader).GetQueueAttributes(request, metadata=self._marked, timeout=timeout_s)
        except grpc.RpcError as error:
            raise error_from_rpc(error, queue=queue) from None


def forward_failure(error: grpc.RpcError, *, queue: str, what: str) -> ShardqError:
    """How a call that changes messages, forwarded to their shard's leader, failed, as its
    caller must hear it: the leader's own answer as the leader gave it (it knows what it
    applied); LeaderUnreachable when the call never reached the leader (nothing applied:
    it may be made again); OUTCOME_UNKNOWN when the connection failed or the time ran out
    after it was sent (`what` failed, and may or may not have been applied)."""
    failure = error_from_rpc(error, queue=queue)
    if answered_by_shardq(error):
        return failure
    say_if_peer_tls_failed(error, f"the leader of a shard of {queue}")
    if never_sent(error):
        return LeaderUnreachable(failure.message)
    return unknown_if_sent(error, failure, what)


def shards_away(queue: str, away: dict[int, ShardqError]) -> str:
    """`orders shard 0 (UNAVAILABLE)`, `orders shards 0 (UNAVAILABLE), 2 (NOT_LEADER)`."""
    # Reasons only: the transport's own words ("Connection refused", "Deadline Exceeded")
    # would read, at the CLI, as though the server the caller called were the one down.
    shards = ", ".join(f"{index} ({error.reason.value})" for index, error in sorted(away.items()))
    return f"{queue} shard{'s' if len(away) > 1 else ''} {shards}"
