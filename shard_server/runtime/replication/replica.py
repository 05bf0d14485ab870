"""One shard replica in a cluster: its role from the shard's Lease, log shipping when
it leads, and commit tracking over the in-sync replicas (DESIGN §5).

- The lease's holder is the leader; its transition count is the epoch. A replica
  notices it has been made leader, applies every entry it holds, raises its
  epoch, and only then serves. It renews the lease and stops serving by itself
  before the lease could have expired, measured on its own monotonic clock from
  the start of the renew request.
- The leader ships entries to each follower; an entry is committed once every
  in-sync replica has persisted it. A follower that stops acknowledging is
  dropped from the ISR only after the smaller set is written to the lease (CAS).
- Followers persist, acknowledge, and apply what the leader reports committed;
  one that applied a divergent entry re-bootstraps from the leader's snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import pathlib
import shutil
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from prometheus_client import Counter

from shard_server import metrics
from shard_server.runtime.committing import GroupCommitter
from shard_server.runtime.replication import rules
from shard_server.runtime.replication.peers import PeerChannels
from shard_server.runtime.serving_tls import say_if_peer_tls_failed
from shard_server.storage import replica_log
from shard_server.storage.codecs import CorruptEntry
from shard_server.storage.lmdb_store import ShardEnvironment
from shardq.api.v1 import replication_pb2
from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.fencing import (
    build_abdication,
    build_epoch_raise,
    build_incarnations,
    build_isr_change,
    build_renewal,
    build_takeover,
    for_another_creation,
    incarnations_of,
    isr_of,
    safe_serving_deadline_ms,
)
from shardq.coordination.leases import LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.placement import ShardId
from shardq.errors import NotLeader, OutcomeUnknown
from shardq.queues import QueueConfig

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.1
HEARTBEAT_S = 0.1
APPEND_TIMEOUT_S = 2.0
MAX_APPEND_ENTRIES = 512
MAX_APPEND_BYTES = 8 << 20
# A follower that has not caught up for this long leaves the ISR (after CAS).
ISR_LAG_MS = 1_000
# How long a reader waits for what it would show to be known committed: a new leader
# learned the old leader's commit index a heartbeat late, and its own needs its
# followers' first answers, or a silent follower dropped from the ISR (ISR_LAG_MS,
# then a lease write).
READERS_WAIT_FOR_COMMIT_S = 3.0
# How long a leader handing off waits for the writes it took to commit first: a silent
# follower leaves the ISR after ISR_LAG_MS and a lease write, and they commit without it.
# Below the kubelet's 2 s minimum grace (a pod deleted with a grace period of 0), so that
# the lease is still passed on before SIGKILL.
HAND_OFF_FINISHES_WRITES_WITHIN_S = 1.5
SNAPSHOT_CHUNK = 1 << 20


class Role(enum.Enum):
    FOLLOWER = "follower"
    PROMOTING = "promoting"
    LEADER = "leader"
    RECOVERING = "recovering"


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class ReplicatedQueue(Protocol):
    """What a replica reads from its queue."""

    @property
    def config(self) -> QueueConfig: ...

    @property
    def uid(self) -> str:
        """Which creation of the queue this is ("" when the map does not say)."""

    def wake(self) -> None:
        """Wake the queue's long polls (a new leader may have messages to hand out)."""


class ReplicatedShard(Protocol):
    """What a replica needs from the shard it replicates: its storage and its writer."""

    index: int
    # Raised by the replica when it leads in a new epoch.
    epoch: int

    @property
    def queue(self) -> ReplicatedQueue: ...

    @property
    def environment(self) -> ShardEnvironment: ...

    @property
    def committer(self) -> GroupCommitter: ...

    @property
    def last_written_index(self) -> int: ...

    def replace_environment(self, environment: ShardEnvironment) -> None:
        """Swap in the environment a snapshot installed."""

    def load_per_second(self) -> float: ...

    def message_count(self) -> int: ...


class ShardReplica:
    """Leadership and replication state of one hosted replica."""

    def __init__(
        self,
        shard: ReplicatedShard,
        *,
        server_id: str,
        cluster: ClusterMap,
        leases: LeaseStore,
        peers: PeerChannels,
        reopen: Callable[[], ShardEnvironment],
    ) -> None:
        self.shard = shard
        self.server_id = server_id
        self.cluster = cluster
        self.leases = leases
        self.peers = peers
        shard_id = ShardId(shard.queue.config.name, shard.index)
        self.name = lease_name(shard_id)
        self.replicas = list(cluster.replicas_of(shard_id))
        self.followers = [r for r in self.replicas if r != server_id]
        self.role = Role.FOLLOWER
        self.leader_id = ""
        self.commit_index = 0
        # The last entry known committed, in any epoch: learned from the leader as a
        # follower, kept through a promotion (where commit_index starts over), so a
        # new leader's readers see at once what the old leader had committed.
        self.known_committed_index = 0
        self._readers: list[tuple[int, asyncio.Future[None]]] = []
        # The last entry written in an earlier epoch, when this replica last took the lead.
        self._inherited_last_index = 0
        self.isr: frozenset[str] = frozenset(self.replicas)
        # Followers being written into the ISR: counted for commits from the moment the
        # leader decides to re-admit them (when they hold every entry written).
        self._joining: frozenset[str] = frozenset()
        self._reopen = reopen
        self._serving_until_ms = 0
        # Set while a leader handing off finishes the writes it took (see hand_off).
        self._finishing_writes = False
        self._renewed_at_ms = 0
        # Whether the lapse going on now (see _count_lapse_if_any) was counted.
        self._lapse_counted = False
        self._match: dict[str, int] = {}
        self._progress_at: dict[str, int] = {}
        # (epoch, log index, future) of writes waiting to be replicated.
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._new_entries = asyncio.Event()
        # The leader's shipper per follower.
        self._shippers: dict[str, asyncio.Task[None]] = {}
        self._recovering: asyncio.Task[None] | None = None
        self._isr_changing = False
        # The highest epoch whose appender this replica saw the lease name (see append),
        # from the epoch its log has seen, which appends so checked recorded.
        self._confirmed_epoch = replica_log.replica_indexes(shard.environment)[0]
        # Which copy of the data this replica holds, and (as leader) the followers'.
        self.incarnation = shard.environment.incarnation()
        self._incarnations: dict[str, str] = {server_id: self.incarnation}
        self._recorded_incarnations: dict[str, str] = {}
        # Readiness (see `in_sync`): the lease's ISR vouches for this copy, and since this
        # process started it has held every entry the leader said was committed.
        self._vouched_for = False
        self._caught_up = False

    def _leadership_changes(self, change: str) -> Counter:
        return metrics.LEADERSHIP_CHANGES.labels(self.shard.queue.config.name, str(self.shard.index), change)

    # -- what the rest of the server asks ------------------------------------------
    def is_serving(self) -> bool:
        return self.role is Role.LEADER and not self._finishing_writes and monotonic_ms() < self._serving_until_ms

    @property
    def in_sync(self) -> bool:
        """Whether this copy may count as in sync for the server's readiness: it leads, or
        the lease's ISR names it (for this copy of the data) and it has caught up with the
        leader's commit index since this process started. The ISR alone is not enough: a
        server restarted within the leader's lag allowance is still named there while it
        lacks the entries committed meanwhile, until the leader's next append finds out."""
        return self.role is Role.LEADER or (self._vouched_for and self._caught_up)

    def leader_address(self) -> str:
        return self.cluster.address_of(self.leader_id)

    def follower_lag(self) -> dict[str, int]:
        """Log entries each follower is behind this leader's last written entry."""
        last = self.shard.last_written_index
        return {follower: max(last - self._match.get(follower, 0), 0) for follower in self.followers}

    def require_serving(self) -> None:
        if not self.is_serving():
            # A leader handing off names nobody: the lease is about to name its heir.
            leader = "" if self._finishing_writes else self.leader_address()
            raise NotLeader(f"{self.name}: this server ({self.server_id}) does not lead the shard", leader=leader)

    def note_local_commit(self, index: int) -> None:
        """The leader wrote entry `index` locally; wake the shippers."""
        if index:
            self._new_entries.set()
            if not self.followers or not (self.isr - {self.server_id}):
                self._advance_commit()

    async def wait_committed(self, index: int, epoch: int) -> None:
        """Resolve once every in-sync replica has persisted entry `index`, written at
        `epoch`. A later epoch's commit index says nothing about this entry: it may
        have been cut off when leadership moved, so only this epoch can commit it."""
        if self.role is not Role.LEADER or epoch != self.shard.epoch:
            raise _lost_before_replication(self.name)
        if index <= self.commit_index:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((epoch, index, future))
        self._advance_commit()
        await future

    async def readable_through(self, index: int) -> int:
        """The last entry a reader may see, up to `index`: the last known committed. An
        entry past it may still be lost in a failover, so a journal reader must not count
        it yet. Entries this leader inherited from an earlier epoch are waited for: the
        old leader may have acknowledged them while this replica, which learns the
        commit index a heartbeat late, did not yet know."""
        await self.wait_known_committed(min(index, self._inherited_last_index))
        return min(index, self.known_committed_index)

    async def wait_known_committed(self, index: int) -> bool:
        """Whether entry `index` is known committed, after waiting for it at most
        READERS_WAIT_FOR_COMMIT_S."""
        if self.known_committed_index < index:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._readers = [(wanted, f) for wanted, f in self._readers if not f.done()]  # timed out
            self._readers.append((index, future))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout=READERS_WAIT_FOR_COMMIT_S)
        return self.known_committed_index >= index

    def _learn_committed(self, index: int) -> None:
        if index <= self.known_committed_index:
            return
        self.known_committed_index = index
        waiting, self._readers = self._readers, []
        for wanted, future in waiting:
            if future.done():
                continue
            if wanted <= index:
                future.set_result(None)
            else:
                self._readers.append((wanted, future))

    def use_cluster(self, cluster: ClusterMap) -> None:
        """Run with a new cluster map. When the shard's replicas changed (a replica move,
        `shardq.coordination.replica_moves`), a leader ships to the new set: a new
        follower starts outside the ISR and joins once it holds everything; a follower
        that left is no longer counted for commits, and leaves the ISR in the lease."""
        self.cluster = cluster
        shards = cluster.placement.get(self.shard.queue.config.name, [])
        if self.shard.index >= len(shards):
            return  # the queue left the map: this replica is being stopped
        replicas = list(shards[self.shard.index])
        if replicas == self.replicas:
            return
        added = [server for server in replicas if server not in self.replicas and server != self.server_id]
        removed = [server for server in self.followers if server not in replicas]
        self.replicas = replicas
        self.followers = [server for server in replicas if server != self.server_id]
        log.info("%s: replicas now %s (added %s, removed %s)", self.name, replicas, added, removed)
        if self.role is not Role.LEADER:
            return
        for follower in removed:
            task = self._shippers.pop(follower, None)
            if task is not None:
                task.cancel()
            self._match.pop(follower, None)
            self._progress_at.pop(follower, None)
            self._incarnations.pop(follower, None)
        for follower in added:
            self._match[follower] = 0
            self._progress_at[follower] = monotonic_ms()
            self._shippers[follower] = asyncio.create_task(self._ship(follower))
        self._advance_commit()
        self._check_isr()

    # -- the watch loop: roles from the lease ------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self._watch_once()
            except Exception:
                log.exception("%s: lease watch failed", self.name)
            await asyncio.sleep(WATCH_PERIOD_S)

    async def _watch_once(self) -> None:
        lease = await asyncio.to_thread(self.leases.get, self.name)
        if lease is None:
            return
        self.leader_id = lease.holder
        mine = lease.holder == self.server_id
        self._vouched_for = (
            self.server_id in isr_of(lease)
            and incarnations_of(lease).get(self.server_id, self.incarnation) == self.incarnation
        )
        if for_another_creation(lease, self.shard.queue.uid):
            # The queue was deleted and made again under its name, and the map saying so
            # has not reached this server yet: its replica goes at the next map read.
            if self.role is Role.LEADER:
                await self.step_down("the lease is for another creation of the queue")
            return
        if self.role is Role.LEADER:
            if not mine or lease.transitions != self.shard.epoch:
                await self.step_down(f"lease now held by {lease.holder or 'nobody'} at epoch {lease.transitions}")
                return
            # Counted now, not only once a renewal succeeds: an API server that stays
            # down (each renewal timing out) would otherwise show no lapse at all.
            self._count_lapse_if_any("no renewal of its lease has succeeded since")
            if monotonic_ms() - self._renewed_at_ms >= lease.duration_ms // 4:
                await self._renew(lease)
            self._check_isr()
        elif (
            mine
            and self.role is Role.FOLLOWER
            and (lease.transitions > self.shard.epoch or self._epoch_seen_above(lease) is not None)
        ):
            try:
                await self._become_leader(lease)
            except BaseException:
                self._abandon_promotion()
                raise

    def _epoch_seen_above(self, lease: LeaseRecord) -> int | None:
        """The epoch this replica's data has seen when the lease is below it, or at it
        under another leader (the Leases were made anew: see build_epoch_raise); else None."""
        seen, led_by = replica_log.epoch_seen(self.shard.environment)
        if seen > lease.transitions or (seen == lease.transitions and led_by not in ("", self.server_id)):
            return seen
        return None

    async def _raise_epoch(self, lease: LeaseRecord, *, above: int, why: str) -> None:
        """Move the lease this replica holds to a new epoch above `above` (CAS); its next
        watch leads in it. Stepping down alone left the shard leaderless until failovers
        had raised the lease past `above`, one lease duration each."""
        try:
            raised = build_epoch_raise(lease, above=above, now_ms=wall_ms())
        except ValueError as error:
            log.error("%s: cannot lead: %s, and %s", self.name, why, error)
            return
        try:
            await asyncio.to_thread(self.leases.update, raised)
        except LeaseConflict:
            return  # the lease changed meanwhile: the next watch decides again
        log.warning("%s: %s: lease epoch raised from %d to %d", self.name, why, lease.transitions, raised.transitions)

    def _abandon_promotion(self) -> None:
        """A half-done promotion must not leave the replica stuck between roles."""
        if self.role is Role.PROMOTING:
            self.role = Role.FOLLOWER

    async def _become_leader(self, lease: LeaseRecord) -> None:
        vouched = incarnations_of(lease).get(self.server_id)
        if vouched is not None and vouched != self.incarnation:
            # The ISR vouched for another copy of this replica's data (it was wiped
            # or rebuilt since): leading would lose what that copy had committed.
            log.error(
                "%s: refusing to lead: the ISR vouches for data incarnation %s, this replica holds %s",
                self.name,
                vouched,
                self.incarnation,
            )
            with contextlib.suppress(LeaseConflict):
                await asyncio.to_thread(self.leases.update, build_abdication(lease, leaving=self.server_id))
            return
        seen_above = self._epoch_seen_above(lease)
        if seen_above is not None:
            await self._raise_epoch(lease, above=seen_above, why=f"this replica has seen epoch {seen_above}")
            return
        self.role = Role.PROMOTING
        epoch = lease.transitions
        fifo = self.shard.queue.config.fifo
        environment = self.shard.environment
        leader = self.server_id
        # On the writer thread, so nothing else touches the environment meanwhile.
        await self.shard.committer.run_exclusive(lambda: replica_log.set_epoch_seen(environment, epoch, leader=leader))
        await self.shard.committer.run_exclusive(lambda: replica_log.apply_whole_log(environment, fifo=fifo))
        self.shard.epoch = epoch
        _, _, last, _ = replica_log.replica_indexes(environment)
        self._inherited_last_index = last
        self._fail_waiters()  # nothing from an earlier term may be answered by this one
        self.isr = isr_of(lease) or frozenset(self.replicas)
        self._recorded_incarnations = incarnations_of(lease)
        self._incarnations = {self.server_id: self.incarnation}
        self._match = dict.fromkeys(self.followers, 0)
        self._progress_at = {f: monotonic_ms() for f in self.followers}
        # Entries inherited from earlier epochs commit once the ISR holds them.
        self.commit_index = 0
        self.role = Role.LEADER
        await self._renew(lease)
        if not self.is_serving():
            await self.step_down("could not renew the lease after promotion")
            return
        self._shippers = {follower: asyncio.create_task(self._ship(follower)) for follower in self.followers}
        self._advance_commit()
        self._leadership_changes("acquired").inc()
        log.info("%s: leading at epoch %d (log up to %d, ISR %s)", self.name, epoch, last, sorted(self.isr))
        self.shard.queue.wake()

    async def _renew(self, lease: LeaseRecord) -> None:
        # Every quarter lease: the serving deadline (three quarters past the
        # request) then always has half a lease of slack.
        started = self._renewed_at_ms = monotonic_ms()
        try:
            renewed = await self._renewal(lease)
        finally:
            metrics.LEASE_RENEWAL_SECONDS.observe((monotonic_ms() - started) / 1000)
        if renewed is None:
            return  # the old deadline stays in force
        self._count_lapse_if_any("its lease was renewed only now")
        margin = renewed.duration_ms // 4
        self._serving_until_ms = safe_serving_deadline_ms(
            started, duration_ms=renewed.duration_ms, clock_skew_margin_ms=margin
        )
        # A renewal requested before the lapse can end past its new deadline too: the
        # lapse goes on, and is counted once, until one requested since ends in time.
        if monotonic_ms() < self._serving_until_ms:
            self._lapse_counted = False

    async def _renewal(self, lease: LeaseRecord) -> LeaseRecord | None:
        """The lease renewed, or None if it changed hands or epochs meanwhile."""
        try:
            return await asyncio.to_thread(self.leases.update, build_renewal(lease, now_ms=wall_ms()))
        except LeaseConflict:
            # Often our own ISR update got in between: read again and retry once,
            # still counting from the first request's start.
            current = await asyncio.to_thread(self.leases.get, self.name)
            if current is None or current.holder != self.server_id or current.transitions != lease.transitions:
                return None  # the next watch steps down
            try:
                return await asyncio.to_thread(self.leases.update, build_renewal(current, now_ms=wall_ms()))
            except LeaseConflict:
                return None

    def _count_lapse_if_any(self, what: str) -> None:
        """Count a lapse when this leader's serving deadline has passed before a renewal
        succeeded: it served nothing from that moment (`is_serving`). Counted once per
        lapse, so that renewals too slow for the lease (an overloaded API server) show
        before shards start failing over."""
        late_ms = monotonic_ms() - self._serving_until_ms
        if self._serving_until_ms == 0 or late_ms < 0 or self._lapse_counted:
            return  # not leading (0), serving still, or counted
        self._lapse_counted = True
        metrics.LEASE_LAPSES.labels(self.shard.queue.config.name, str(self.shard.index)).inc()
        log.warning("%s: stopped serving: %s, %d ms past its serving deadline", self.name, what, late_ms)

    async def step_down(self, why: str, *, handing_off: bool = False) -> None:
        if self.role is not Role.LEADER and self.role is not Role.PROMOTING:
            return
        log.warning("%s: stepping down: %s", self.name, why)
        if self.role is Role.LEADER:
            self._count_lapse_if_any("no renewal of its lease had succeeded")
            if not handing_off:
                self._leadership_changes("lost").inc()
        self.role = Role.FOLLOWER
        self._serving_until_ms = 0
        self._finishing_writes = False
        self._lapse_counted = False
        # Fail waiting writes first, synchronously: nothing below may prevent it.
        self._fail_waiters()
        # A shipper may be the caller: never cancel (or wait for) the running task.
        current = asyncio.current_task()
        others = [task for task in self._shippers.values() if task is not current]
        self._shippers = {}
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def hand_off(self) -> str:
        """Stop leading and give the lease to an in-sync follower at once, in a new epoch,
        instead of leaving the shard without a leader until the lease expires (graceful
        shutdown: a rolling restart, a scale-in, a pod deleted). The follower that holds
        the most of the log is chosen; every in-sync follower holds every committed entry,
        and writes not yet committed were answered as unknown when this leader stepped
        down. The heir's name, or "" when there was nothing to hand off (the lease then
        expires and failover decides, as before).

        The writes already taken are answered first: this replica takes no new calls
        (NOT_LEADER: the caller follows the shard or, unkeyed, moves to another one),
        and its committer's batches commit, until HAND_OFF_FINISHES_WRITES_WITHIN_S.
        Stepping down at once answered each of them OUTCOME_UNKNOWN (whenever a rolling
        restart caught a send in flight), though they were a heartbeat from committing."""
        if self.role is not Role.LEADER:
            return ""
        self._finishing_writes = True
        try:
            await asyncio.wait_for(self._writes_finished(), timeout=HAND_OFF_FINISHES_WRITES_WITHIN_S)
        except TimeoutError:
            log.warning(
                "%s: writes still uncommitted after %gs of handing off: answered as unknown",
                self.name,
                HAND_OFF_FINISHES_WRITES_WITHIN_S,
            )
        if self.role is not Role.LEADER:
            return ""  # the lease was lost meanwhile: the waiting writes were answered
        epoch = self.shard.epoch
        match = dict(self._match)
        await self.step_down("handing leadership off", handing_off=True)
        heir = await self._pass_lease(epoch, match)
        if not heir:
            self._leadership_changes("lost").inc()
            return ""
        self._leadership_changes("handed-off").inc()
        log.info("%s: leadership handed to %s at epoch %d", self.name, heir, epoch + 1)
        return heir

    async def _writes_finished(self) -> None:
        """Once every batch queued here has been written and replicated (or the lease was
        lost, which answers the waiting writes)."""
        await self.shard.committer.until_idle()
        with contextlib.suppress(OutcomeUnknown):
            await self.wait_committed(self.shard.last_written_index, self.shard.epoch)

    async def _pass_lease(self, epoch: int, match: dict[str, int]) -> str:
        """Give the lease of `epoch` to the in-sync follower holding the most of the log;
        its name, or "" when the lease moved on meanwhile or no follower may take it."""
        lease = await asyncio.to_thread(self.leases.get, self.name)
        if lease is None or lease.holder != self.server_id or lease.transitions != epoch:
            return ""
        heirs = [server for server in isr_of(lease) if server != self.server_id and server in self.followers]
        if not heirs:
            return ""
        heir = max(heirs, key=lambda server: (match.get(server, 0), server))
        taken = build_takeover(lease, new_holder=heir, now_ms=wall_ms(), duration_ms=lease.duration_ms)
        # This copy leaves the ISR (the heir must not wait for its acknowledgements),
        # unless fewer than two copies would be vouched for: when every server stops at
        # once the hand-offs chain, and the last heir alone would be the only copy allowed
        # to lead afterwards, though this one holds every committed entry too.
        remaining = isr_of(lease) - {self.server_id}
        isr = remaining if len(remaining) >= 2 else isr_of(lease)
        try:
            await asyncio.to_thread(self.leases.update, build_isr_change(taken, isr))
        except LeaseConflict:
            return ""
        return heir

    def _fail_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for _, _, future in waiters:
            if not future.done():
                future.set_exception(_lost_before_replication(self.name))

    # -- leader: shipping and commit ----------------------------------------------------
    def _advance_commit(self) -> None:
        if self.role is not Role.LEADER:
            return
        self.commit_index = rules.commit_index(
            last_written=self.shard.last_written_index,
            match=self._match,
            followers=self.followers,
            # A joiner counts already: an entry committed without it while the lease
            # write was in flight would be missing from an ISR member, which could then
            # be promoted without it (and the member was dropped again at once for
            # lacking a committed entry: the ISR flapped on most rejoins under load).
            isr=self.isr | self._joining,
            current=self.commit_index,
        )
        self._learn_committed(self.commit_index)
        if not self._waiters:
            return
        remaining = []
        for epoch, index, future in self._waiters:
            if epoch != self.shard.epoch:
                if not future.done():
                    future.set_exception(_lost_before_replication(self.name))
            elif index <= self.commit_index:
                if not future.done():
                    future.set_result(None)
            else:
                remaining.append((epoch, index, future))
        self._waiters = remaining

    async def _ship(self, follower: str) -> None:
        stub = self.peers.stub(follower)
        next_index = self.shard.last_written_index + 1
        while self.role is Role.LEADER:
            environment = self.shard.environment  # re-read: snapshots swap it
            _, first, last, _ = replica_log.replica_indexes(environment)
            entries: list[bytes] = []
            prev_index = next_index - 1
            if next_index < first:
                prev_index, prev_epoch = first - 1, 0  # we no longer hold what it needs
            else:
                prev_epoch = (replica_log.entry_epoch_at(environment, prev_index) or 0) if prev_index else 0
                entries = replica_log.read_entries(
                    environment, from_index=next_index, max_entries=MAX_APPEND_ENTRIES, max_bytes=MAX_APPEND_BYTES
                )
            request = replication_pb2.AppendRequest(
                queue=self.shard.queue.config.name,
                shard=self.shard.index,
                epoch=self.shard.epoch,
                leader_id=self.server_id,
                prev_index=prev_index,
                prev_epoch=prev_epoch,
                entries=entries,
                commit_index=self.commit_index,
            )
            try:
                response = await stub.Append(request, metadata=self.peers.metadata, timeout=APPEND_TIMEOUT_S)
            except grpc.RpcError as error:
                say_if_peer_tls_failed(error, follower)
                await asyncio.sleep(HEARTBEAT_S)
                continue
            outcome = response.outcome
            if response.incarnation:
                self._incarnations[follower] = response.incarnation
            if outcome in (replication_pb2.APPEND_OUTCOME_MISMATCH, replication_pb2.APPEND_OUTCOME_NEEDS_SNAPSHOT):
                # It holds less than we believed (restarted empty, or cut a tail): an
                # ISR member must hold every committed entry, so this is checked now.
                self._match[follower] = min(self._match.get(follower, 0), response.last_index)
                self._check_isr()
            if outcome == replication_pb2.APPEND_OUTCOME_OK:
                matched = prev_index + len(entries)
                if matched > self._match.get(follower, 0) or matched >= last:
                    self._progress_at[follower] = monotonic_ms()
                self._match[follower] = matched
                next_index = matched + 1
                self._advance_commit()
                self._check_isr()
                if not entries:
                    # Clear, then look: an entry written while this append was in
                    # flight (or whose wake-up another shipper cleared) is shipped
                    # now rather than a heartbeat later, which cost replicated
                    # writes a p99 of ~120 ms.
                    self._new_entries.clear()
                    if self.shard.last_written_index <= matched:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._new_entries.wait(), timeout=HEARTBEAT_S)
            elif outcome == replication_pb2.APPEND_OUTCOME_STALE_EPOCH:
                epoch = self.shard.epoch
                why = f"follower {follower} has seen epoch {response.epoch} ({response.detail or 'a later one'})"
                await self.step_down(why)
                # A later leader stepped in (the lease has moved on), or the Leases were
                # made anew below what the follower saw: only then does this one still
                # hold the lease at its epoch, and it leads again above the follower's.
                lease = await asyncio.to_thread(self.leases.get, self.name)
                if lease is not None and lease.holder == self.server_id and lease.transitions == epoch:
                    await self._raise_epoch(lease, above=max(response.epoch, epoch), why=why)
                return
            elif outcome == replication_pb2.APPEND_OUTCOME_MISMATCH:
                next_index = max(1, min(next_index - 1, response.last_index + 1))
            else:  # needs a snapshot or refused: it pulls the snapshot itself
                await asyncio.sleep(HEARTBEAT_S * 5)
                next_index = self.shard.last_written_index + 1

    def _check_isr(self) -> None:
        """Drop a follower that lacks committed entries or lags, re-admit a caught-up one,
        and keep the recorded data incarnations current: all by CAS on the lease."""
        if self.role is not Role.LEADER or self._isr_changing:
            return
        wanted = rules.isr_after_check(
            leader=self.server_id,
            followers=self.followers,
            isr=self.isr,
            match=self._match,
            last_written=self.shard.last_written_index,
            commit_index=self.commit_index,
            known_incarnations=self._incarnations,
            progress_at_ms=self._progress_at,
            now_ms=monotonic_ms(),
            lag_ms=ISR_LAG_MS,
        )
        incarnations = {member: self._incarnations[member] for member in wanted if member in self._incarnations}
        if wanted != self.isr or incarnations != self._recorded_incarnations:
            self._isr_changing = True
            self._joining = wanted - self.isr
            asyncio.get_running_loop().create_task(self._write_isr(wanted, incarnations))

    async def _write_isr(self, isr: frozenset[str], incarnations: dict[str, str]) -> None:
        try:
            lease = await asyncio.to_thread(self.leases.get, self.name)
            if lease is None or lease.holder != self.server_id or lease.transitions != self.shard.epoch:
                await self.step_down("lease changed while updating the ISR")
                return
            changed = build_incarnations(build_isr_change(lease, isr), incarnations)
            await asyncio.to_thread(self.leases.update, changed)
            if isr != self.isr:
                log.info("%s: ISR is now %s", self.name, sorted(isr))
            # Only after the lease records the smaller set may commits go on without the dropped one.
            self.isr = isr
            self._recorded_incarnations = incarnations
            self._advance_commit()
        except LeaseConflict:
            pass  # retried on the next check
        finally:
            self._isr_changing = False
            if self._joining:
                self._joining = frozenset()  # members now, or not admitted after all
                self._advance_commit()

    # -- follower -------------------------------------------------------------------------
    async def append(self, request: replication_pb2.AppendRequest) -> replication_pb2.AppendResponse:
        if request.leader_id not in self.cluster.servers or request.leader_id not in self.replicas:
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_REFUSED, detail=f"{request.leader_id!r} is not a replica"
            )
        if self.role is Role.RECOVERING:
            return replication_pb2.AppendResponse(outcome=replication_pb2.APPEND_OUTCOME_NEEDS_SNAPSHOT)
        if self.role is not Role.FOLLOWER and request.epoch <= self.shard.epoch:
            # The appender is behind this leader: it steps down on hearing so.
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_STALE_EPOCH, epoch=self.shard.epoch
            )
        # Only the lease's holder at that epoch may append: a forged or replayed
        # request naming another leader is refused.
        lease = await asyncio.to_thread(self.leases.get, self.name)
        if lease is not None and for_another_creation(lease, self.shard.queue.uid):
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_REFUSED, detail="the lease is for another creation of the queue"
            )
        named = lease is not None and lease.transitions == request.epoch and lease.holder == request.leader_id
        if lease is not None and lease.transitions == request.epoch and not named:
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_REFUSED, detail="not the lease holder at that epoch"
            )
        if request.epoch > self._confirmed_epoch or self.role is Role.LEADER:
            # A new epoch is believed, and a leader steps down for it, only once the
            # lease names its appender. Any client could once send an epoch of 2**63: a
            # leader stepped down for it, and a follower recorded it and refused its real
            # leader as stale from then on. (A lease this server reads late delays a real
            # new leader's first append here by its retry, half a second.)
            if not named:
                return replication_pb2.AppendResponse(
                    outcome=replication_pb2.APPEND_OUTCOME_REFUSED,
                    detail=f"the lease does not name {request.leader_id!r} at epoch {request.epoch}",
                )
            self._confirmed_epoch = max(self._confirmed_epoch, request.epoch)
        if self.role is Role.LEADER:  # at an epoch below the request's, checked above
            await self.step_down(f"{request.leader_id} leads at epoch {request.epoch}")
        environment = self.shard.environment
        fifo = self.shard.queue.config.fifo
        entries = list(request.entries)
        try:
            outcome = await self.shard.committer.run_exclusive(
                lambda: replica_log.append_as_follower(
                    environment,
                    epoch=request.epoch,
                    leader=request.leader_id,
                    prev_index=request.prev_index,
                    prev_epoch=request.prev_epoch,
                    entries=entries,
                    commit_index=request.commit_index,
                    fifo=fifo,
                )
            )
        except (CorruptEntry, struct.error) as error:
            # Its write transaction was aborted: nothing of it was kept. Before, the
            # caller got UNKNOWN with a Python exception's text.
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_REFUSED, detail=f"not a log entry: {error}"
            )
        self.leader_id = request.leader_id
        self.commit_index = max(self.commit_index, min(request.commit_index, outcome.last_index))
        if outcome.result is replica_log.AppendResult.OK:
            # Only what this append matched: a longer tail here may be an old epoch's.
            matched = request.prev_index + len(entries)
            self._learn_committed(min(request.commit_index, matched))
            if matched >= request.commit_index:
                self._caught_up = True  # readiness: it holds everything committed
        if outcome.result is replica_log.AppendResult.NEEDS_SNAPSHOT and self._recovering is None:
            self._recovering = asyncio.create_task(self._bootstrap(request.leader_id))
        return replication_pb2.AppendResponse(
            outcome=_OUTCOMES[outcome.result],
            epoch=outcome.epoch,
            last_index=outcome.last_index,
            detail=outcome.detail,
            incarnation=self.incarnation,
        )

    async def _bootstrap(self, leader: str) -> None:
        """Replace this replica's state with a snapshot of the leader's."""
        self.role = Role.RECOVERING
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="shardq-snapshot-"))
        try:
            data_file = scratch / "data.mdb"
            received = 0
            with data_file.open("wb") as sink:
                request = replication_pb2.SnapshotRequest(
                    queue=self.shard.queue.config.name, shard=self.shard.index, requester_id=self.server_id
                )
                async for chunk in self.peers.stub(leader).Snapshot(request, metadata=self.peers.metadata, timeout=600):
                    sink.write(chunk.data)
                    received += len(chunk.data)
            directory = self.shard.environment.path

            def swap() -> ShardEnvironment:
                self.shard.environment.close()
                replica_log.install_snapshot(directory, data_file)
                environment = self._reopen()
                # The copy carries the leader's incarnation; this is a new copy of its own.
                environment.renew_incarnation()
                return environment

            self.shard.replace_environment(await self.shard.committer.run_exclusive(swap))
            self.incarnation = self.shard.environment.incarnation()
            log.info(
                "%s: bootstrapped from %s's snapshot (%d bytes), data incarnation now %s",
                self.name,
                leader,
                received,
                self.incarnation,
            )
        except (grpc.RpcError, OSError) as error:
            log.warning("%s: snapshot from %s failed: %s", self.name, leader, error)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self.role = Role.FOLLOWER
            self._recovering = None

    async def snapshot(self) -> AsyncIterator[replication_pb2.SnapshotChunk]:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="shardq-copy-"))
        try:
            data_file, last = await asyncio.to_thread(replica_log.snapshot_to, self.shard.environment, scratch)
            total = data_file.stat().st_size
            with data_file.open("rb") as source:
                first = True
                while chunk := await asyncio.to_thread(source.read, SNAPSHOT_CHUNK):
                    if first:
                        yield replication_pb2.SnapshotChunk(
                            data=chunk, last_index=last, epoch=self.shard.epoch, total_bytes=total
                        )
                        first = False
                    else:
                        yield replication_pb2.SnapshotChunk(data=chunk)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def status(self) -> replication_pb2.ReplicaStatus:
        epoch, _, last, applied = replica_log.replica_indexes(self.shard.environment)
        roles = {
            Role.LEADER: replication_pb2.REPLICA_ROLE_LEADER,
            Role.PROMOTING: replication_pb2.REPLICA_ROLE_FOLLOWER,
            Role.FOLLOWER: replication_pb2.REPLICA_ROLE_FOLLOWER,
            Role.RECOVERING: replication_pb2.REPLICA_ROLE_RECOVERING,
        }
        return replication_pb2.ReplicaStatus(
            queue=self.shard.queue.config.name,
            shard=self.shard.index,
            role=roles[self.role],
            epoch=max(epoch, self.shard.epoch),
            last_index=last,
            commit_index=self.commit_index,
            applied_index=applied,
            isr=sorted(self.isr) if self.role is Role.LEADER else [],
            load=self.shard.load_per_second(),
            messages=self.shard.message_count(),
        )


def _lost_before_replication(name: str) -> OutcomeUnknown:
    return OutcomeUnknown(f"{name}: leadership was lost before the write was replicated; it may or may not be stored")


_OUTCOMES = {
    replica_log.AppendResult.OK: replication_pb2.APPEND_OUTCOME_OK,
    replica_log.AppendResult.STALE_EPOCH: replication_pb2.APPEND_OUTCOME_STALE_EPOCH,
    replica_log.AppendResult.MISMATCH: replication_pb2.APPEND_OUTCOME_MISMATCH,
    replica_log.AppendResult.NEEDS_SNAPSHOT: replication_pb2.APPEND_OUTCOME_NEEDS_SNAPSHOT,
}
