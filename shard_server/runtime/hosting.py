"""A queue a server hosts: its shards (runtime.hosted_shards), long polling, routing.

HostedQueue turns queue-level requests into per-shard domain calls submitted to
each shard's group committer, and wakes long-polling receivers when a commit
may have made a message visible. QueueHost (runtime.queue_hosts) holds every queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import pathlib
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from prometheus_client import Counter

from shard_server import metrics
from shard_server.domain import acknowledging, housekeeping, receiving, sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import Delivery, MessageRecord, NewMessage
from shard_server.domain.receiving import ClaimedMessage
from shard_server.domain.routing import choose_shard, give_content_dedup_ids
from shard_server.domain.sending import SendOutcome
from shard_server.runtime.committing import Work, WriterThreads, wall_clock_ms
from shard_server.runtime.forwarding import LEADER_AWAY_REASONS, LeaderCalls, LeaderUnreachable, Router, shards_away
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.storage import replica_log
from shard_server.storage.lmdb_store import (
    LmdbShardTransaction,
    ShardEnvironment,
    ShardStats,
)
from shard_server.storage.queue_directories import claim_queue_directory, held_uid
from shardq.api.v1 import queue_pb2
from shardq.errors import InvalidArgument, NotLeader, QueueNotFound, Reason, ShardqError, Unavailable
from shardq.queues import QueueConfig
from shardq.receipts import MalformedReceipt, Receipt, decode_receipt, encode_receipt

log = logging.getLogger(__name__)

_SHARD_DIR = re.compile(r"shard-(\d+)")
_Answer = TypeVar("_Answer")
# How old the depth of shards led elsewhere may grow before a send checking max_depth
# asks their leaders again (in the background: the send goes on with the last reports).
REMOTE_DEPTH_REFRESH_S = 1.0
# How long a leader elsewhere has to report its shards' depth.
REMOTE_DEPTH_WITHIN_S = 2.0
# How often a waiting receiver in a cluster asks the other leaders again.
REMOTE_POLL_MS = 250
# What one receive may claim, in message bytes: the response must stay under
# gRPC's 64 MiB message limit. Each shard's claim may pass what is left by one
# message (the first is taken whatever its size), and the search stops there,
# so a response holds at most 32 + 16 MiB (the largest message) plus envelopes.
RECEIVE_BYTES_BUDGET = 32 * 1024 * 1024
# Up to this many calls in progress, an unkeyed send joins a shard's batch still taking
# requests rather than opening one on its round-robin shard (see HostedQueue._send).
JOIN_OPEN_BATCHES_UP_TO_CALLS = 8


# A receipt call whose shard's leader moved is tried again on fresh routes after these
# pauses (doubling), for up to a lease duration.
FAILOVER_RETRY_FIRST_S = 0.05
FAILOVER_RETRY_MAX_S = 0.5
# A forwarded send whose leader applied nothing (it was not the leader any more, or never
# reached: its port refused, its name not yet published) is tried again on fresh routes
# for this many lease durations: the dead leader's lease runs out, is taken over, and the
# new holder starts leading. Never past SEND_FOLLOWS_FAILOVER_WITHIN_S: the caller's
# deadline (30 s by default) must leave room for the answer, or a send that was never
# made would read as one that might have been.
SEND_FOLLOWS_FAILOVER_LEASES = 3
SEND_FOLLOWS_FAILOVER_WITHIN_S = 10.0


class LookingForTheNextLeader:
    """The pace of a call that follows a shard whose leader applied nothing to the next
    one: pauses doubling from FAILOVER_RETRY_FIRST_S to FAILOVER_RETRY_MAX_S, the routes
    read again after each, until `within_s` after the first such answer."""

    def __init__(self, router: Router, *, within_s: float) -> None:
        self._router = router
        self._within_s = within_s
        self._gives_up_at: float | None = None
        self._pause_s = FAILOVER_RETRY_FIRST_S

    async def again(self) -> bool:
        """Wait, then read the routes again; False, at once, once the time is up."""
        now = asyncio.get_running_loop().time()
        if self._gives_up_at is None:
            self._gives_up_at = now + self._within_s
        elif now >= self._gives_up_at:
            return False
        await asyncio.sleep(self._pause_s)
        self._pause_s = min(2 * self._pause_s, FAILOVER_RETRY_MAX_S)
        await asyncio.to_thread(self._router.refresh)
        return True


@dataclasses.dataclass(slots=True)
class Peeked:
    """What a peek found: (shard, record, delivery) led here, and what other leaders
    showed (passed through as they encoded it)."""

    local: list[tuple[int, MessageRecord, Delivery]]
    remote: list[queue_pb2.ReceivedMessage]


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """Messages claimed here, and messages another leader claimed for this call."""

    local: list[tuple[HostedShard, ClaimedMessage]]
    remote: list[queue_pb2.ReceivedMessage]

    def __len__(self) -> int:
        return len(self.local) + len(self.remote)


class HostedQueue:
    def __init__(
        self,
        config: QueueConfig,
        directory: pathlib.Path,
        *,
        map_size: int,
        writers: WriterThreads,
        local_shards: Sequence[int] | None = None,
        router: Router | None = None,
        uid: str = "",
    ) -> None:
        """Host `local_shards` (all shards when standalone) of the queue in `directory`.

        Standalone (no router): every shard is local and led here. Cluster mode:
        only the shards placed on this server are local, leadership comes from
        their leases, and the router forwards the rest to their leaders. `uid` names
        the creation of the queue (the cluster map's): data in `directory` of another
        creation is deleted first (`queue_directories`).
        """
        self.config = config
        self.uid = uid
        claim_queue_directory(directory, uid)
        self.router = router
        self._waiters: set[asyncio.Future[None]] = set()
        self._round_robin = itertools.count()
        # Set when a receive dead-letters something; the mover then runs at once.
        self.dead_letters_waiting = asyncio.Event()
        _refuse_orphaned_shards(config, directory)
        self.directory = directory
        # Set when the queue is deleted: calls still holding it answer QUEUE_NOT_FOUND.
        self.closed = False
        # Claims handed back after their caller went away (kept so they are not collected).
        self._giving_back: set[asyncio.Task[list[Reason | None]]] = set()
        # Depth of shards led elsewhere, as their leaders last reported (max_depth).
        self._remote_depth: dict[int, int] = {}
        self._remote_depth_read_at = 0.0
        self._remote_depth_reading: asyncio.Task[None] | None = None
        self._remote_depth_reported = False
        self.map_size = map_size
        self.writers = writers
        self.shards: list[HostedShard] = []
        indexes = range(config.shards) if local_shards is None else local_shards
        for index in indexes:
            environment = self.open_environment(index)
            recovered = replica_log.recover_committed_ahead(environment, fifo=config.fifo)
            if recovered:
                log.warning(
                    "queue %r shard %d: applied the log entries up to %d from the commit-ahead file "
                    "(answered, but not yet durable in LMDB when the server stopped)",
                    config.name,
                    index,
                    recovered,
                )
            if router is None:
                # Standalone leadership: every start is a new epoch, so a claim made
                # just before a crash (answered, never committed) can never be
                # confused with a claim made after the restart.
                epoch = environment.epoch() + 1
                environment.set_epoch(epoch)
            else:
                epoch = environment.epoch()  # raised by the lease when this replica leads
            self.shards.append(
                HostedShard(self, index, environment, epoch, replicated=router is not None, writers=writers)
            )
        self.by_index = {shard.index: shard for shard in self.shards}

    def adopt_uid(self, uid: str) -> None:
        """Take `uid` as this queue's, where the map named none when it was opened (a map
        written before uids): the data here is that creation's."""
        if not uid or self.uid:
            return
        if not held_uid(self.directory):
            claim_queue_directory(self.directory, uid)
        self.uid = uid

    def add_shard(self, index: int) -> HostedShard:
        """Host a replica of shard `index` placed here by a replica move (cluster mode); it
        starts empty and follows its leader, which sends it a snapshot."""
        if index in self.by_index:
            raise ValueError(f"queue {self.config.name!r} shard {index} is hosted here already")
        assert self.router is not None, "only a cluster's shards move"
        # Whatever a directory of that name holds is an earlier copy (the server held this
        # replica before, or the queue's namesake): the new replica starts empty.
        shutil.rmtree(self.directory / f"shard-{index}", ignore_errors=True)
        environment = self.open_environment(index)
        shard = HostedShard(self, index, environment, environment.epoch(), replicated=True, writers=self.writers)
        self.shards.append(shard)
        self.shards.sort(key=lambda hosted: hosted.index)
        self.by_index[index] = shard
        return shard

    async def remove_shard(self, index: int) -> None:
        """Stop hosting shard `index` (its replica moved away) and delete its data here."""
        shard = self.by_index.pop(index)
        self.shards.remove(shard)
        await shard.committer.close()
        shard.environment.close()
        await asyncio.to_thread(shutil.rmtree, self.directory / f"shard-{index}", True)

    def open_environment(self, index: int) -> ShardEnvironment:
        return ShardEnvironment(
            self.directory / f"shard-{index}",
            queue=self.config.name,
            shard=index,
            map_size=self.map_size,
            # Replicated shards send followers what LMDB holds, and answer once it replicated.
            commit_ahead=self.writers.commit_ahead and self.router is None,
        )

    async def _other_shards_depth(self, target: int) -> int:
        """Messages held by the queue's shards other than `target` (for max_depth).

        Shards led here are read now; shards led elsewhere count as their leaders
        last reported. Reports older than REMOTE_DEPTH_REFRESH_S are asked for
        again in the background, all leaders at once; only the first reports are
        waited for. Before, the send that found them old asked each leader in turn
        and waited: a hung leader (a frozen pod) held one send a second for 2 s,
        two hung leaders for 4. Concurrent sends to different shards may each miss
        the other's batch: the queue may then exceed max_depth by up to one batch
        per shard.
        """
        local = sum(shard.message_count() for shard in self.shards if shard.index != target and shard.is_local_leader())
        if self.router is None:
            return local
        if time.monotonic() - self._remote_depth_read_at >= REMOTE_DEPTH_REFRESH_S:
            reading = self._remote_depth_read()
            if not self._remote_depth_reported:
                # Shielded: a caller that goes away does not end the reading for the others.
                await asyncio.shield(reading)
        remote = sum(
            depth for index, depth in self._remote_depth.items() if index != target and self.leader_here(index) is None
        )
        return local + remote

    def _remote_depth_read(self) -> asyncio.Task[None]:
        """The reading of the remote leaders' reports under way, started if none is."""
        if self._remote_depth_reading is None or self._remote_depth_reading.done():
            self._remote_depth_read_at = time.monotonic()
            self._remote_depth_reading = asyncio.create_task(self._read_remote_depth())
        return self._remote_depth_reading

    async def _read_remote_depth(self) -> None:
        router = self.router
        assert router is not None
        reports = await asyncio.gather(
            *(
                router.calls.queue_attributes(leader, self.config.name, timeout_s=REMOTE_DEPTH_WITHIN_S)
                for leader in self.remote_leaders()
            ),
            return_exceptions=True,
        )
        for report in reports:
            if isinstance(report, ShardqError):
                continue  # keep its last report
            if isinstance(report, BaseException):
                # No send waits for a later reading: logged here, or nowhere.
                log.error(
                    "queue %r: reading the depth of shards led elsewhere failed", self.config.name, exc_info=report
                )
                continue
            for shard in report.shards:
                self._remote_depth[shard.shard] = (
                    shard.visible + shard.in_flight + shard.delayed + shard.dead_letter_pending
                )
        self._remote_depth_reported = True

    def _open_batch_shard(self, start: int) -> int:
        """The shard for an unkeyed send: see _send."""
        shards = self.config.shards
        if self.writers.calls.count <= JOIN_OPEN_BATCHES_UP_TO_CALLS:
            for offset in range(shards):
                local = self.leader_here((start + offset) % shards)
                if local is not None and local.committer.collecting:
                    return local.index
        return start % shards

    def leader_here(self, index: int) -> HostedShard | None:
        shard = self.by_index.get(index)
        return shard if shard is not None and shard.is_local_leader() else None

    def not_leader(self, index: int) -> NotLeader:
        leader = ""
        if self.router is not None:
            leader = self.router.address_of(self.router.leader_of(self.config.name, index)[0])
        return NotLeader(f"queue {self.config.name!r} shard {index} is not led by this server", leader=leader)

    def no_leader_known(self, index: int) -> Unavailable | None:
        """Why shard `index` cannot be asked now, if no leader is known for it (for a moment
        after its leader's lease lapsed): forwarding needs one to call."""
        if self.router is None or self.leader_here(index) is not None:
            return None
        if self.router.leader_of(self.config.name, index)[0]:
            return None
        return Unavailable(f"no leader of queue {self.config.name!r} shard {index} is known")

    def _route_elsewhere(self, index: int) -> str:
        """The server the routes name as shard `index`'s leader, for a call to forward there;
        "" when they name none (for a moment after a lease was given up) or this server
        (whose leadership has not begun, or has ended): there is nobody to forward to."""
        assert self.router is not None
        leader = self.router.leader_of(self.config.name, index)[0]
        return "" if leader == self.router.server_id else leader

    def _leader_elsewhere(self, index: int) -> str:
        """`_route_elsewhere`, or NOT_LEADER when there is nobody to forward to."""
        leader = self._route_elsewhere(index)
        if not leader:
            raise self.not_leader(index)
        return leader

    def leaders_to_ask(self) -> list[str]:
        """`remote_leaders` but those that left a short poll unanswered lately: where a
        receive (or a peek) with nothing here looks for messages (Router.answering)."""
        return [] if self.router is None else self.router.answering(self.remote_leaders())

    def remote_leaders(self) -> list[str]:
        """Server ids leading some shard of this queue elsewhere."""
        if self.router is None:
            return []
        leaders = {
            self.router.leader_of(self.config.name, index)[0]
            for index in range(self.config.shards)
            if self.leader_here(index) is None
        }
        leaders.discard("")
        leaders.discard(self.router.server_id)
        return sorted(leaders)

    def shards_led_by(self, leader: str) -> list[int]:
        """The shards of this queue the routes name `leader` the leader of, but not led here."""
        if self.router is None:
            return []
        return [
            index
            for index in range(self.config.shards)
            if self.leader_here(index) is None and self.router.leader_of(self.config.name, index)[0] == leader
        ]

    async def ask_other_leaders(
        self, call: Callable[[LeaderCalls, str], Awaitable[_Answer]]
    ) -> tuple[list[tuple[list[int], _Answer]], dict[int, ShardqError]]:
        """`call` made to every other leader of this queue at once (a hung one costs it one
        timeout, not one each; one that fails keeps no other from being asked): the
        answers, each with the shards its leader led when asked (the routes may change
        meanwhile), and the shards whose leader is away, with why. Any other failure (the
        queue deleted, a refused request) is raised."""
        if self.router is None:
            return [], {}
        calls = self.router.calls
        led_by = {leader: self.shards_led_by(leader) for leader in self.remote_leaders()}
        answers = await asyncio.gather(*(call(calls, leader) for leader in led_by), return_exceptions=True)
        answered: list[tuple[list[int], _Answer]] = []
        away: dict[int, ShardqError] = {}
        for shards, answer in zip(led_by.values(), answers, strict=True):
            if isinstance(answer, ShardqError) and answer.reason in LEADER_AWAY_REASONS:
                away.update(dict.fromkeys(shards, answer))
            elif isinstance(answer, BaseException):
                raise answer
            else:
                answered.append((shards, answer))
        return answered, away

    # -- waking long pollers ---------------------------------------------------
    def wake(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for_change(self, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout=max(timeout_s, 0.0))
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    # -- send --------------------------------------------------------------------
    async def send(
        self, messages: Sequence[NewMessage], *, shard: int | None = None, forwarded: bool = False
    ) -> list[SendOutcome]:
        """Store messages, each on its routed shard (or all on `shard`).

        Shards led elsewhere get their part forwarded to the leader, unless this
        call was itself forwarded: then they are refused with NOT_LEADER.
        """
        with self.writers.calls:
            return await self._send(messages, shard=shard, forwarded=forwarded)

    async def _send(self, messages: Sequence[NewMessage], *, shard: int | None, forwarded: bool) -> list[SendOutcome]:
        max_depth = self.config.max_depth
        if max_depth and len(messages) > max_depth:
            # No retry can succeed: say so, rather than "queue full, retry later".
            raise InvalidArgument(
                "messages",
                f"a batch of {len(messages)} can never fit queue {self.config.name!r} (its max depth is {max_depth})",
            )
        if self.config.content_based_dedup and not forwarded and give_content_dedup_ids(messages):
            # The ids choose the shard: a client that pinned these messages elsewhere did
            # not know the queue dedups by content (its map predates the setting).
            shard = None
        by_shard: dict[int, list[int]] = {}
        start = next(self._round_robin)
        keyed = self.config.fifo or any(message.dedup_id for message in messages)
        if shard is not None or not keyed:
            # Unkeyed messages of a batch all take the batch's round-robin shard, unless few
            # calls are in progress and a shard led here has a batch still taking requests:
            # joining it shares that batch's fsync instead of queueing one more behind it on
            # the writer. (Joining at any load halved unary sends at 64 in flight: with every
            # call in one batch, the writer and the event loop took turns instead of overlapping.)
            target = shard if shard is not None else self._open_batch_shard(start)
            by_shard[target] = list(range(len(messages)))
        else:
            for position, message in enumerate(messages):
                by_shard.setdefault(choose_shard(self.config, message, round_robin=start), []).append(position)
        entries: list[SendOutcome | None] = [None] * len(messages)

        async def send_to(index: int, positions: list[int]) -> None:
            batch = [messages[p] for p in positions]
            local = self.leader_here(index)
            try:
                if local is not None:
                    stored = await self._send_local(local, batch)
                elif forwarded or self.router is None:
                    raise self.not_leader(index)
                else:
                    stored = await self._send_remote(index, batch, movable=shard is None and not keyed)
            except ShardqError as error:
                if local is not None:  # a remote leader counts its own refusals
                    metrics.SENDS_REFUSED.labels(self.config.name, str(index), error.reason.value).inc(len(positions))
                for position in positions:
                    entries[position] = SendOutcome("", 0, index, False, error)
                return
            for position, entry in zip(positions, stored, strict=True):
                entries[position] = entry

        if len(by_shard) == 1:
            ((index, positions),) = by_shard.items()
            await send_to(index, positions)
        else:
            await asyncio.gather(*(send_to(i, p) for i, p in by_shard.items()))
        outcomes = [entry for entry in entries if entry is not None]
        assert len(outcomes) == len(messages), "every message has an outcome"
        errors = [outcome.error for outcome in outcomes if outcome.error is not None]
        if errors and len(errors) == len(outcomes):
            raise errors[0]  # nothing was stored: fail the whole call
        return outcomes

    async def _send_local(self, shard: HostedShard, batch: list[NewMessage]) -> list[SendOutcome]:
        others = await self._other_shards_depth(shard.index) if self.config.max_depth else 0
        outcomes = await shard.committer.submit(
            lambda tx, context, now: sending.send_messages(tx, context, batch, now_ms=now, other_shards_depth=others)
        )
        duplicates = sum(1 for outcome in outcomes if outcome.duplicate)
        shard.sent.inc(len(outcomes) - duplicates)
        # Bytes stored: one pass over the bodies; the rare duplicates' are taken off after.
        stored_bytes = sum(map(len, (message.body for message in batch)))
        if duplicates:
            stored_bytes -= sum(
                len(message.body) for message, outcome in zip(batch, outcomes, strict=True) if outcome.duplicate
            )
        shard.bytes_in.inc(stored_bytes)
        if duplicates:
            shard.duplicates.inc(duplicates)
        return outcomes

    async def _send_remote(self, index: int, batch: list[NewMessage], *, movable: bool) -> list[SendOutcome]:
        """`batch` sent to shard `index`'s leader elsewhere. While that leader applies
        nothing (NOT_LEADER, or never reached), a `movable` batch (unkeyed, unpinned:
        any shard will do) goes to another shard's leader at once; otherwise, or when no
        other leader takes it, it follows the shard through its failover: the routes are
        read again and the send goes to whoever leads then, here included. A client
        sending through a Service heard UNAVAILABLE for every send to a shard whose leader
        had just died, or whose peer name was not yet published."""
        assert self.router is not None
        lease_s = self.router.cluster.lease_duration_ms / 1000
        looking = LookingForTheNextLeader(
            self.router, within_s=min(SEND_FOLLOWS_FAILOVER_LEASES * lease_s, SEND_FOLLOWS_FAILOVER_WITHIN_S)
        )
        while True:
            shard = self.leader_here(index)
            if shard is not None:  # leadership came here meanwhile
                return await self._send_local(shard, batch)
            try:
                return await self.router.calls.send_messages(
                    self._leader_elsewhere(index), self.config.name, index, batch
                )
            except (NotLeader, LeaderUnreachable):
                if movable:
                    movable = False  # once: the other leaders were just asked
                    moved = await self._send_to_another_shard(index, batch)
                    if moved is not None:
                        return moved
                if not await looking.again():
                    raise

    async def _send_to_another_shard(self, unled: int, batch: list[NewMessage]) -> list[SendOutcome] | None:
        """An unkeyed batch meant for shard `unled`, whose leader applied nothing, stored
        on another shard: one led here first (no hop), then the others' leaders in turn;
        None if none of them could be reached either."""
        assert self.router is not None
        others = [(unled + offset) % self.config.shards for offset in range(1, self.config.shards)]
        for index in sorted(others, key=lambda index: self.leader_here(index) is None):
            local = self.leader_here(index)
            try:
                if local is not None:
                    outcomes = await self._send_local(local, batch)
                else:
                    leader = self._route_elsewhere(index)
                    if not leader:
                        continue
                    outcomes = await self.router.calls.send_messages(leader, self.config.name, index, batch)
            except (NotLeader, LeaderUnreachable):
                continue
            metrics.SENDS_MOVED.labels(self.config.name, str(unled)).inc(len(batch))
            return outcomes
        return None

    # -- receive -----------------------------------------------------------------
    async def receive(
        self,
        *,
        max_messages: int,
        visibility_timeout_ms: int,
        wait_ms: int,
        shard: int | None = None,
        forwarded: bool = False,
        delete_on_receive: bool = False,
    ) -> Received:
        """Claim up to max_messages, long-polling up to wait_ms for the first; with
        `delete_on_receive`, delete them in the same commit and answer once it is durable.

        Local leader shards are tried first; a server with nothing to hand out
        asks the other leaders (without waiting) before it waits itself.
        """
        with self.writers.calls:
            return await self._receive(
                max_messages=max_messages,
                visibility_timeout_ms=visibility_timeout_ms,
                wait_ms=wait_ms,
                shard=shard,
                forwarded=forwarded,
                delete_on_receive=delete_on_receive,
            )

    async def receive_shares(
        self,
        shares: Sequence[int],
        *,
        visibility_timeout_ms: int,
        shard: int | None = None,
        forwarded: bool = False,
        delete_on_receive: bool = False,
    ) -> list[Received]:
        """Several receivers' short polls at once (a client folding concurrent calls):
        each share claims as a receive of its own would, in order, and the shares go to
        each shard's writer as one request, so they share its batch and commit.

        The response must stay as bounded as one receive's: each share may claim
        RECEIVE_BYTES_BUDGET / len(shares) bytes, the first share passing it by at most
        one message and the others never (a message too large for a share waits for
        another receive). Shares claim from the shards led here; when none claimed
        anything, the whole request goes to the other leaders in turn, each bounding
        its answer alike. With `delete_on_receive`, each share's messages are deleted in
        the same commit (see receive).
        """
        with self.writers.calls:
            if shard is not None and self.leader_here(shard) is None:
                if forwarded or self.router is None:
                    raise self.not_leader(shard)
                return await self._receive_shares_remote(
                    self._leader_elsewhere(shard),
                    shares,
                    visibility_timeout_ms,
                    shard,
                    delete_on_receive=delete_on_receive,
                )
            if self.closed:
                raise QueueNotFound(self.config.name)
            local = [s for s in self.shards if s.is_local_leader() and (shard is None or s.index == shard)]
            budget = RECEIVE_BYTES_BUDGET // len(shares)
            # The shares claim together, in order, each as the receive of its own it stands
            # for: one request per shard's batch, not one per share (a claim lost after some
            # shares claimed returns what they have; the others get nothing this time).
            claimed = await self._claim_now(
                local,
                [_Wanted(wanted, budget, strict_bytes=position > 0) for position, wanted in enumerate(shares)],
                visibility_timeout_ms,
                delete_on_receive=delete_on_receive,
            )
            if any(claimed):
                return [Received(messages, []) for messages in claimed]
            if not forwarded and shard is None:
                for leader in self.leaders_to_ask():
                    try:
                        elsewhere = await self._receive_shares_remote(
                            leader, shares, visibility_timeout_ms, None, delete_on_receive=delete_on_receive
                        )
                    except ShardqError as error:
                        if delete_on_receive and error.reason is Reason.OUTCOME_UNKNOWN:
                            raise  # that leader may have deleted what it took: see _receive_remote
                        continue  # that leader is unreachable: the others may still serve
                    if any(elsewhere):
                        return elsewhere
            return [Received([], []) for _ in shares]

    async def _receive_shares_remote(
        self,
        leader: str,
        shares: Sequence[int],
        visibility_timeout_ms: int,
        shard: int | None,
        *,
        delete_on_receive: bool = False,
    ) -> list[Received]:
        assert self.router is not None
        parts = await self.router.calls.receive_shares(
            leader,
            self.config.name,
            shares,
            visibility_timeout_ms=visibility_timeout_ms,
            shard=shard,
            delete_on_receive=delete_on_receive,
        )
        return [Received([], part) for part in parts]

    async def _receive(
        self,
        *,
        max_messages: int,
        visibility_timeout_ms: int,
        wait_ms: int,
        shard: int | None,
        forwarded: bool,
        delete_on_receive: bool,
    ) -> Received:
        if shard is not None and self.leader_here(shard) is None:
            if forwarded or self.router is None:
                raise self.not_leader(shard)
            leader = self._leader_elsewhere(shard)
            return Received(
                [],
                await self._receive_remote(
                    leader, max_messages, visibility_timeout_ms, wait_ms, shard, delete_on_receive=delete_on_receive
                ),
            )
        deadline = wall_clock_ms() + wait_ms
        while True:
            if self.closed:
                raise QueueNotFound(self.config.name)  # deleted while this call waited
            local = [s for s in self.shards if s.is_local_leader() and (shard is None or s.index == shard)]
            (claimed,) = await self._claim_now(
                local,
                [_Wanted(max_messages, RECEIVE_BYTES_BUDGET)],
                visibility_timeout_ms,
                delete_on_receive=delete_on_receive,
            )
            if claimed:
                return Received(claimed, [])
            if not forwarded and shard is None:
                for leader in self.leaders_to_ask():
                    elsewhere = await self._receive_remote(
                        leader, max_messages, visibility_timeout_ms, 0, None, delete_on_receive=delete_on_receive
                    )
                    if elsewhere:
                        return Received([], elsewhere)
            now = wall_clock_ms()
            if now >= deadline:
                return Received([], [])
            wake_at = deadline
            if self.router is not None:
                wake_at = min(wake_at, now + REMOTE_POLL_MS)  # other leaders cannot wake us
            for local_shard in local:
                visible_at = local_shard.next_visible_at()
                if visible_at is not None:
                    wake_at = min(wake_at, max(visible_at, now + 1))
            with self.writers.calls.paused():  # waiting for messages is no work in progress
                await self._wait_for_change((wake_at - now) / 1000)

    async def peek(self, *, max_messages: int, shard: int | None, forwarded: bool) -> Peeked:
        """The messages a receive would hand out now, without claiming them: up to
        `max_messages` per leader (the service merges them oldest first)."""
        await self.until_committed()
        if shard is not None and self.leader_here(shard) is None:
            if forwarded or self.router is None:
                raise self.not_leader(shard)
            return Peeked(local=[], remote=await self._peek_remote(self._leader_elsewhere(shard), max_messages, shard))
        now = wall_clock_ms()
        local = [s for s in self.shards if s.is_local_leader() and (shard is None or s.index == shard)]
        found = Peeked(local=[], remote=[])
        for hosted in local:

            def look(hosted: HostedShard = hosted) -> list[tuple[int, MessageRecord, Delivery]]:
                with hosted.environment.read() as tx:
                    # In the order a receive would claim them: the higher lanes' first.
                    seqs = [key[-1] for key in tx.eligible_by_priority(now, after=None, limit=max_messages)]
                    first = set(seqs)
                    seqs += [seq for _, seq in tx.eligible(now, after=None, limit=max_messages) if seq not in first]
                    pairs = [(tx.get_record(seq), tx.get_delivery(seq)) for seq in seqs[:max_messages]]
                return [(hosted.index, r, d) for r, d in pairs if r is not None and d is not None]

            # On the writer thread, after the batches already queued: a receive answered
            # before its commit is seen by a peek that follows it.
            found.local += await hosted.committer.run_exclusive(look)
        if not forwarded and shard is None:
            # All leaders at once: a hung one costs the peek one short poll, not one each.
            # One that does not answer is left out, as a receive leaves it (and the next
            # peeks skip it for a while): the others' messages are still shown.
            leaders = self.leaders_to_ask()
            for leader, shown in zip(
                leaders,
                await asyncio.gather(
                    *(self._peek_remote(leader, max_messages, None) for leader in leaders), return_exceptions=True
                ),
                strict=True,
            ):
                if isinstance(shown, ShardqError):
                    log.info("queue %r: peek left out the shards led by %s: %s", self.config.name, leader, shown)
                elif isinstance(shown, BaseException):
                    raise shown
                else:
                    found.remote += shown
        return found

    async def _peek_remote(self, leader: str, max_messages: int, shard: int | None) -> list[queue_pb2.ReceivedMessage]:
        assert self.router is not None
        return await self.router.calls.receive_messages(
            leader, self.config.name, max_messages=max_messages, shard=shard, peek=True
        )

    async def _receive_remote(
        self,
        leader: str,
        max_messages: int,
        visibility_timeout_ms: int,
        wait_ms: int,
        shard: int | None,
        *,
        delete_on_receive: bool = False,
    ) -> list[queue_pb2.ReceivedMessage]:
        assert self.router is not None
        try:
            return await self.router.calls.receive_messages(
                leader,
                self.config.name,
                max_messages=max_messages,
                visibility_timeout_ms=visibility_timeout_ms,
                wait_ms=wait_ms,
                shard=shard,
                delete_on_receive=delete_on_receive,
            )
        except ShardqError as error:
            if shard is not None:
                raise
            if delete_on_receive and error.reason is Reason.OUTCOME_UNKNOWN:
                # The leader may have deleted what it received for this call: the caller
                # must hear that, not an empty answer that reads as nothing lost.
                raise
            return []  # that leader is unreachable: the others may still serve

    async def _claim_now(
        self,
        shards: list[HostedShard],
        wants: list[_Wanted],
        visibility_timeout_ms: int,
        *,
        delete_on_receive: bool = False,
    ) -> list[list[tuple[HostedShard, ClaimedMessage]]]:
        """Claim now from `shards`, for each of `wants` in order (a receive, or the shares
        of a shared one), as many messages as it wants within its bytes: what each claimed.
        With `delete_on_receive`, deleted in the same commit, answered once it is durable."""
        claimed: list[list[tuple[HostedShard, ClaimedMessage]]] = [[] for _ in wants]
        if not shards:
            return claimed  # none led here (cluster mode): the caller asks their leaders
        now = wall_clock_ms()
        count = len(shards)
        start = receiving.first_shard_to_claim(now, count)
        claimed_bytes = [0] * len(wants)
        rotation = [shards[(start + offset) % count] for offset in range(count)]
        # Shards whose next batch is still taking requests come first: a claim there shares
        # that transaction and fsync, and so, later, do the deletes of what concurrent
        # consumers claimed together. Otherwise the rotation decides: one shard first for a
        # turn (concurrent receives then share its commits), every shard in turn.
        collecting = [shard for shard in rotation if shard.committer.collecting]
        # Which wants still want something (by position), and what: all of them, whole, until
        # a shard's claim leaves some short.
        wanting = list(range(len(wants)))
        rest = wants
        for shard in collecting + [shard for shard in rotation if shard not in collecting]:
            visible_at = shard.next_visible_at()
            if visible_at is None or visible_at > now:
                continue  # a read transaction is far cheaper than a write batch
            if not shard.is_local_leader():
                continue  # led elsewhere since the caller listed it
            # Queued now, not from a task of its own a loop turn later: receives made in
            # the same turn then find this batch still taking requests, and share it.
            if delete_on_receive:
                # No answer before the commit: a crash would bring back a message its caller
                # was handed as deleted, and it would be handed out again.
                submitted = shard.committer.enqueue(
                    functools.partial(_claim_and_delete, wants=rest, visibility_timeout_ms=visibility_timeout_ms)
                )
            else:
                submitted = shard.committer.enqueue(
                    functools.partial(_claim, wants=rest, visibility_timeout_ms=visibility_timeout_ms),
                    answer_before_commit=_newest_seq,
                )
            try:
                outcomes = await asyncio.shield(submitted)
            except ShardqError:
                # This shard's claim was lost (its leadership went before it replicated):
                # its messages come back at their timeout. What other shards claimed stands.
                if any(claimed):
                    break
                raise
            except asyncio.CancelledError:
                # The caller went away (a client cancelled, a consumer stream closed):
                # what this call claimed, and what the claim in flight will claim,
                # becomes visible again now instead of at its visibility timeout (unless
                # deleted as received: at most once, so those are gone).
                if not delete_on_receive:
                    self._give_back([message for messages in claimed for message in messages])
                    submitted.add_done_callback(functools.partial(self._give_back_outcomes, shard))
                raise
            for position, outcome in zip(wanting, outcomes, strict=True):
                claimed_bytes[position] += outcome.claimed_bytes
                claimed[position].extend((shard, message) for message in outcome.claimed)
            self._count_claims(shard, outcomes)
            if delete_on_receive:
                shard.deleted.inc(sum(len(outcome.claimed) for outcome in outcomes))
            wanting = [
                position
                for position in wanting
                if len(claimed[position]) < wants[position].messages
                and claimed_bytes[position] < wants[position].max_bytes
            ]
            if not wanting:
                break
            rest = [
                _Wanted(
                    wants[position].messages - len(claimed[position]),
                    wants[position].max_bytes - claimed_bytes[position],
                    strict_bytes=wants[position].strict_bytes,
                )
                for position in wanting
            ]
        return claimed

    def _count_claims(self, shard: HostedShard, outcomes: list[receiving.ReceiveOutcome]) -> None:
        claimed_bytes = dead_lettered = received = redelivered = 0
        for outcome in outcomes:  # one pass, not a generator per figure: once per receive
            claimed_bytes += outcome.claimed_bytes
            dead_lettered += outcome.dead_lettered
            received += len(outcome.claimed)
            redelivered += sum(1 for c in outcome.claimed if c.delivery.receive_count > 1)
        shard.bytes_out.inc(claimed_bytes)
        if dead_lettered:
            shard.dead_lettered.inc(dead_lettered)
            self.wake_dead_letter_mover()
        if received:
            shard.received.inc(received)
        if redelivered:
            shard.redelivered.inc(redelivered)

    def wake_dead_letter_mover(self) -> None:
        self.dead_letters_waiting.set()

    def _give_back_outcomes(
        self, shard: HostedShard, submitted: asyncio.Future[list[receiving.ReceiveOutcome]]
    ) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            self._give_back([(shard, message) for outcome in submitted.result() for message in outcome.claimed])

    def _give_back(self, claimed: Sequence[tuple[HostedShard, ClaimedMessage]]) -> None:
        """Make messages claimed for a caller that is gone visible again, in the background."""
        if not claimed:
            return
        changes = [(encode_receipt(message.receipt), 0) for _, message in claimed]
        task = asyncio.create_task(self.change_visibility(changes))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    # -- acting on receipts ----------------------------------------------------
    def _decode(self, receipts: Sequence[str]) -> tuple[list[Reason | None], dict[int, list[tuple[int, Receipt]]]]:
        results: list[Reason | None] = [None] * len(receipts)
        by_shard: dict[int, list[tuple[int, Receipt]]] = {}
        for position, text in enumerate(receipts):
            try:
                receipt = decode_receipt(text)
            except MalformedReceipt:
                results[position] = Reason.MALFORMED_RECEIPT
                continue
            if receipt.shard >= self.config.shards:
                results[position] = Reason.WRONG_QUEUE
                continue
            by_shard.setdefault(receipt.shard, []).append((position, receipt))
        return results, by_shard

    async def _act_on_receipts(
        self,
        receipts: Sequence[str],
        act: Callable[[LmdbShardTransaction, ShardContext, Receipt, int, int], Reason | None],
        succeeded_counter: Callable[[HostedShard], Counter] | None,
        forward: Callable[[str, list[int]], Awaitable[list[Reason | None]]],
        *,
        forwarded: bool,
    ) -> list[Reason | None]:
        """Apply `act(tx, context, receipt, position, now)` to every receipt, per shard;
        `forward(leader, positions)` sends the positions of a remote shard to its leader."""
        # The calls in progress decide whether a lone batch may commit on the event loop.
        with self.writers.calls:
            results, by_shard = self._decode(receipts)

            def record(items: list[tuple[int, Receipt]], outcomes: Sequence[Reason | None]) -> None:
                for (position, _), outcome in zip(items, outcomes, strict=True):
                    results[position] = outcome

            def act_locally(items: list[tuple[int, Receipt]]) -> Work[list[Reason | None]]:
                def work(tx: LmdbShardTransaction, context: ShardContext, now: int) -> list[Reason | None]:
                    return [act(tx, context, receipt, position, now) for position, receipt in items]

                return work

            def finish_locally(
                shard: HostedShard, items: list[tuple[int, Receipt]], outcomes: list[Reason | None]
            ) -> None:
                record(items, outcomes)
                succeeded = outcomes.count(None)
                if succeeded < len(outcomes):
                    shard.count_rejections(outcomes)
                if succeeded and succeeded_counter is not None:
                    succeeded_counter(shard).inc(succeeded)

            async def act_elsewhere(index: int, items: list[tuple[int, Receipt]]) -> None:
                assert self.router is not None
                looking = LookingForTheNextLeader(self.router, within_s=self.router.cluster.lease_duration_ms / 1000)
                while True:
                    shard = self.leader_here(index)
                    if shard is not None:  # leadership came here meanwhile
                        finish_locally(shard, items, await shard.committer.enqueue(act_locally(items)))
                        return
                    leader = self._route_elsewhere(index)
                    if leader:
                        unreached = False
                        try:
                            outcomes = await forward(leader, [position for position, _ in items])
                        except ShardqError as error:
                            outcomes = [error.reason] * len(items)
                            unreached = isinstance(error, LeaderUnreachable)  # so nothing was applied
                        record(items, outcomes)
                        # NOT_LEADER applied nothing either: those receipts may go to whoever leads now.
                        items = [
                            item
                            for item, outcome in zip(items, outcomes, strict=True)
                            if unreached or outcome is Reason.NOT_LEADER
                        ]
                    else:
                        record(items, [Reason.NOT_LEADER] * len(items))
                    # Leadership moved since the last route refresh (a leader that was
                    # stopped or cut off answers NOT_LEADER once it learns, and the lease's
                    # new holder may not lead yet): look again, for up to a lease duration.
                    # A shard failing over has its new leader within about a lease duration
                    # of the first NOT_LEADER: the old lease expires, is taken over, and the
                    # new holder starts leading. (Counted from the answer, not the call: a
                    # stopped leader answers only once it runs again, seconds later.) The
                    # claims live on in the new leader, so acting there keeps a delete from
                    # turning into a redelivery.
                    if not items or not await looking.again():
                        return

            local: list[tuple[HostedShard, list[tuple[int, Receipt]], asyncio.Future[list[Reason | None]]]] = []
            remote = []
            for index, items in by_shard.items():
                shard = self.leader_here(index)
                if shard is not None:
                    # Queued straight on each shard's committer: no task per shard.
                    local.append((shard, items, shard.committer.enqueue(act_locally(items))))
                elif forwarded or self.router is None:
                    record(items, [Reason.NOT_LEADER] * len(items))
                else:
                    remote.append(act_elsewhere(index, items))
            await asyncio.gather(*remote, *(future for _, _, future in local))
            for shard, items, future in local:
                finish_locally(shard, items, future.result())
            return results

    @property
    def _calls(self) -> LeaderCalls:
        assert self.router is not None
        return self.router.calls

    async def delete(self, receipts: Sequence[str], *, forwarded: bool = False) -> list[Reason | None]:
        return await self._act_on_receipts(
            receipts,
            lambda tx, context, receipt, _, now: acknowledging.delete_message(tx, context, receipt, now_ms=now),
            lambda shard: shard.deleted,
            lambda leader, positions: self._calls.delete_messages(
                leader, self.config.name, [receipts[p] for p in positions]
            ),
            forwarded=forwarded,
        )

    async def release(
        self, receipts: Sequence[str], *, reason: str = "", forwarded: bool = False
    ) -> list[Reason | None]:
        return await self._act_on_receipts(
            receipts,
            lambda tx, context, receipt, _, now: acknowledging.release_message(
                tx, context, receipt, now_ms=now, reason=reason
            ),
            lambda shard: shard.released,
            lambda leader, positions: self._calls.release_messages(
                leader, self.config.name, [receipts[p] for p in positions], reason=reason
            ),
            forwarded=forwarded,
        )

    def check_dead_letter_queue(self, field: str) -> None:
        """Raise InvalidArgument naming `field` unless the queue has a dead-letter queue."""
        if not self.config.dead_letter_queue:
            raise InvalidArgument(
                field,
                f"queue {self.config.name!r} has no dead-letter queue to send them to (set deadLetterQueue and "
                "maxReceiveCount); release them instead",
            )

    async def dead_letter(
        self, receipts: Sequence[str], *, reason: str = "", forwarded: bool = False
    ) -> list[Reason | None]:
        """Dead-letter the claimed messages now (acknowledging.dead_letter_message), each on
        its shard's leader; the dead-letter mover then moves them. InvalidArgument if the
        queue has no dead-letter queue: nothing would take them, and nothing is dropped."""
        self.check_dead_letter_queue("dead_letter")
        outcomes = await self._act_on_receipts(
            receipts,
            lambda tx, context, receipt, _, now: acknowledging.dead_letter_message(
                tx, context, receipt, now_ms=now, reason=reason
            ),
            lambda shard: shard.rejected_to_dead_letters,
            lambda leader, positions: self._calls.release_messages(
                leader, self.config.name, [receipts[p] for p in positions], reason=reason, dead_letter=True
            ),
            forwarded=forwarded,
        )
        if None in outcomes:
            self.wake_dead_letter_mover()
        return outcomes

    async def change_visibility(
        self, changes: Sequence[tuple[str, int]], *, forwarded: bool = False
    ) -> list[Reason | None]:
        timeouts = [timeout for _, timeout in changes]
        return await self._act_on_receipts(
            [receipt for receipt, _ in changes],
            lambda tx, context, receipt, position, now: acknowledging.change_visibility(
                tx, context, receipt, visibility_timeout_ms=timeouts[position], now_ms=now
            ),
            None,
            lambda leader, positions: self._calls.change_visibility(
                leader, self.config.name, [changes[p] for p in positions]
            ),
            forwarded=forwarded,
        )

    # -- administration ----------------------------------------------------------
    async def purge(self, *, forwarded: bool = False) -> int:
        local = [shard for shard in self.shards if shard.is_local_leader()]
        counts = await asyncio.gather(
            *(
                shard.committer.submit(lambda tx, context, now: housekeeping.purge(tx, context, now_ms=now))
                for shard in local
            )
        )
        for shard, count in zip(local, counts, strict=True):
            shard.purged.inc(count)
        if not forwarded:
            metrics.PURGES.labels(self.config.name).inc()
        total = sum(counts)
        if forwarded or self.router is None:
            return total
        # A leader that fails no longer keeps the leaders after it from purging their shards.
        answered, away = await self.ask_other_leaders(lambda calls, leader: calls.purge(leader, self.config.name))
        purged_elsewhere: set[int] = set()
        for shards, purged in answered:
            total += purged
            purged_elsewhere.update(shards)
        purged_here = {shard.index for shard in local}
        for index in range(self.config.shards):
            if index not in purged_here and index not in purged_elsewhere and index not in away:
                # Nobody was asked: no leader known (its lease lapsed a moment ago), or the
                # routes name this server, whose leadership has not begun.
                away[index] = self.no_leader_known(index) or self.not_leader(index)
        if away:
            # Not a success that reads as an empty queue: the caller is told what is left.
            raise Unavailable(
                f"purge of {self.config.name!r} removed {total} messages but did not reach "
                f"{shards_away(self.config.name, away)}: their messages remain; purge again after the failover"
            )
        return total

    async def until_committed(self) -> None:
        """Return once LMDB holds every batch of this queue's local shards answered so far
        (commit ahead answers before LMDB's commit): reads made after it see them."""
        for shard in self.shards:
            await shard.committer.until_committed()

    def stats(self) -> list[tuple[HostedShard, ShardStats]]:
        """Stats of the shards led here (all of them when standalone), with their shard."""
        return [(shard, shard.stats()) for shard in self.shards if shard.is_local_leader()]

    async def close(self) -> None:
        self.closed = True
        if self._remote_depth_reading is not None:
            self._remote_depth_reading.cancel()
        self.wake()  # long polls wake, and find the queue closed
        for shard in self.shards:
            await shard.committer.close()
            shard.environment.close()


@dataclasses.dataclass(slots=True)  # not frozen: built per receive, and frozen ones cost ~4x to build
class _Wanted:
    """What one receive (or one share of a shared receive) still wants claimed."""

    messages: int
    max_bytes: int
    # Never pass max_bytes, not even by the first message (a share after the first).
    strict_bytes: bool = False


def _claim(
    tx: LmdbShardTransaction, context: ShardContext, now: int, *, wants: list[_Wanted], visibility_timeout_ms: int
) -> list[receiving.ReceiveOutcome]:
    """Each want's claim in turn, in one transaction: as receives queued in that order."""
    return [
        receiving.receive_messages(
            tx,
            context,
            max_messages=want.messages,
            visibility_timeout_ms=visibility_timeout_ms,
            now_ms=now,
            max_bytes=want.max_bytes,
            strict_bytes=want.strict_bytes,
        )
        for want in wants
    ]


def _claim_and_delete(
    tx: LmdbShardTransaction, context: ShardContext, now: int, *, wants: list[_Wanted], visibility_timeout_ms: int
) -> list[receiving.ReceiveOutcome]:
    """_claim, then the claimed messages deleted in the same transaction (delete_on_receive)."""
    outcomes = _claim(tx, context, now, wants=wants, visibility_timeout_ms=visibility_timeout_ms)
    for outcome in outcomes:
        acknowledging.delete_claimed(tx, context, outcome.claimed, now_ms=now)
    return outcomes


def _newest_seq(outcomes: list[receiving.ReceiveOutcome]) -> int:
    """The newest message the claims hand out (0 for none): see receiving.newest_seq."""
    return max((receiving.newest_seq(outcome) for outcome in outcomes), default=0)


def _refuse_orphaned_shards(config: QueueConfig, directory: pathlib.Path) -> None:
    """Shrinking a queue's shard count would strand the messages of the shards dropped."""
    if not directory.exists():
        return
    for child in directory.iterdir():
        match = _SHARD_DIR.fullmatch(child.name)
        if match and int(match.group(1)) >= config.shards:
            raise ValueError(
                f"queue {config.name!r} has data in {child} but is configured with {config.shards} shards; "
                "shard counts can grow but not shrink"
            )
