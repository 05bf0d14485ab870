"""Pure decisions over what the supervisor observed: which shard leases to take over, and for whom.

No I/O and no clock: `now_ms` is a parameter. The supervisor reads processes, leases and
replica status, calls these functions, and carries out each `Takeover` as one lease
compare-and-swap (`fencing.build_takeover`), so a decision taken on stale facts fails
the CAS instead of doing harm. The choices themselves are `shardq.coordination.placement`'s.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.fencing import (
    build_incarnations,
    build_isr_change,
    build_queue_uid,
    build_takeover,
    is_expired,
    isr_of,
)
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.placement import (
    ClusterState,
    LeadershipMove,
    ServerState,
    ShardId,
    ShardState,
    choose_failover_candidate,
    choose_leadership_moves,
    choose_replica_move_for_load,
    compute_leader_loads,
)

# Leadership moves cost a new epoch and a hand-over; below this many requests per second on
# the hottest server there is nothing worth evening out.
MIN_LOAD_TO_REBALANCE = 5.0
IMBALANCE_THRESHOLD = 0.25
# What leading one shard weighs when choosing where a failed-over shard goes, in requests
# per second: enough to break ties between idle servers, noise beside real load.
LED_SHARD_LOAD = 1.0


class TakeoverReason(enum.StrEnum):
    HOLDER_DIED = "holder-died"  # the holder's process exited (or was replaced by a new one)
    HOLDER_RESTARTED = "holder-restarted"  # nobody in sync is ready yet: a starting in-sync replica leads, new epoch
    LEASE_EXPIRED = "lease-expired"  # the holder runs but stopped renewing (hung, paused, partitioned)
    LEASE_RETAKEN = "lease-retaken"  # a ready holder let it lapse, nobody else in sync is ready: it again, new epoch
    REBALANCE = "rebalance"  # a leadership move off a hot server
    REPLICA_MOVE = "replica-move"  # the leader's replica is leaving its server (scale-in, replica balance)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerObservation:
    """A server process as the supervisor sees it. Times are wall-clock ms on the supervisor's clock."""

    name: str
    running: bool
    # When the current process was started: a lease acquired before this belongs to an
    # earlier incarnation, which may have answered writes the new one no longer has.
    started_at_ms: int
    # When the current process was first seen ready to serve; None while it starts.
    ready_since_ms: int | None = None
    load: float = 0.0
    # When the current process, having been ready, stopped passing its readiness checks
    # (hung, paused, overloaded); None while it is ready or has not been ready yet.
    unready_since_ms: int | None = None

    @property
    def ready(self) -> bool:
        return self.running and self.ready_since_ms is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Takeover:
    lease: LeaseRecord  # as read: the CAS succeeds only if nobody wrote it since
    new_holder: str
    reason: TakeoverReason


@dataclasses.dataclass(frozen=True, slots=True)
class Waiting:
    """A shard that needs a new leader and has no safe candidate yet: nobody is promoted."""

    lease: LeaseRecord
    reason: TakeoverReason


def build_initial_lease(*, shard: ShardId, replicas: Sequence[str], now_ms: int, duration_ms: int) -> LeaseRecord:
    """A new shard's first lease: its placement leader holds it in epoch 1, every replica in sync.

    Every replica starts empty, so all of them hold every committed entry (none).
    """
    record = LeaseRecord(
        name=lease_name(shard),
        holder=replicas[0],
        acquire_time_ms=now_ms,
        renew_time_ms=now_ms,
        duration_ms=duration_ms,
        transitions=1,
    )
    return build_isr_change(record, replicas)


def lease_for_new_shard(
    existing: LeaseRecord | None,
    *,
    shard: ShardId,
    replicas: Sequence[str],
    now_ms: int,
    duration_ms: int,
    queue_uid: str = "",
) -> LeaseRecord:
    """The lease a newly placed shard starts with: `build_initial_lease` when the name is
    new; when a deleted queue of the same name left its lease behind, that lease in the
    next epoch, held by the placement leader, every new (empty) replica in sync and no
    data incarnation vouched for, so receipts of the old queue never match the new one.
    Either names the queue's creation (`queue_uid`, the map's), so replicas of the old
    one still running ignore it. Create the first kind, update (CAS) the second."""
    if existing is None:
        fresh = build_initial_lease(shard=shard, replicas=replicas, now_ms=now_ms, duration_ms=duration_ms)
        return build_queue_uid(fresh, queue_uid)
    taken = build_takeover(existing, new_holder=replicas[0], now_ms=now_ms, duration_ms=duration_ms)
    return build_queue_uid(build_incarnations(build_isr_change(taken, replicas), {}), queue_uid)


def holder_incarnation_is_gone(lease: LeaseRecord, servers: Mapping[str, ServerObservation]) -> bool:
    """True when the process that acquired the lease no longer runs.

    A restarted server keeps its name, so "the holder runs" is not enough: it must be the
    same process that was running when the lease was acquired.
    """
    holder = servers.get(lease.holder)
    return holder is None or not holder.running or holder.started_at_ms > lease.acquire_time_ms


def holder_stopped_renewing(lease: LeaseRecord, servers: Mapping[str, ServerObservation], now_ms: int) -> bool:
    """True when a running holder let its lease expire although it had time to renew it.

    A holder that is still starting, or became ready less than one lease duration ago,
    has not had its chance yet; judging it would move leadership at every cluster start.
    A holder that was ready in this incarnation and no longer is (a paused or hung process
    fails its readiness checks as it fails to renew) had its chance: were it judged only
    while ready, a paused leader would keep its shard unled for as long as it stays paused.
    """
    holder = servers.get(lease.holder)
    if holder is None or not is_expired(lease, now_ms):
        return False
    if holder.ready_since_ms is not None:
        return now_ms - holder.ready_since_ms >= lease.duration_ms
    return holder.unready_since_ms is not None


def choose_failover(
    *,
    lease: LeaseRecord,
    shard: ShardId,
    replicas: Sequence[str],
    servers: Mapping[str, ServerObservation],
    now_ms: int,
) -> Takeover | Waiting | None:
    """What to do with one shard lease: nothing (None), a takeover, or wait for a safe candidate.

    Only an in-sync replica on a ready server is promoted (planning.choose_failover_candidate).
    When the holder's process died and no in-sync replica is ready yet (a cluster restart, or
    the holder was the only one in sync), a running in-sync replica that is still starting
    takes the lease in a new epoch: the shard's placement leader if it qualifies, else the
    restarted holder itself (the ISR always holds the leader). The new epoch fences
    whatever the holder's previous process answered. A ready holder that let its lease
    expire, with no other in-sync replica ready, takes it again in a new epoch.
    """
    if holder_incarnation_is_gone(lease, servers):
        reason = TakeoverReason.HOLDER_DIED
    elif holder_stopped_renewing(lease, servers, now_ms):
        reason = TakeoverReason.LEASE_EXPIRED
    else:
        return None
    isr = isr_of(lease)
    state = ShardState(shard=shard, replicas=tuple(replicas), leader=lease.holder or None, isr=isr)
    ready = [ServerState(name=server.name, load=server.load) for server in servers.values() if server.ready]
    candidate = choose_failover_candidate(state, ready)
    if candidate is not None:
        return Takeover(lease=lease, new_holder=candidate, reason=reason)
    if reason is TakeoverReason.HOLDER_DIED:
        # The shard's placement leader first, so a restarted cluster gets its even spread
        # of leaders back; then the holder. Either is in sync, so neither loses a write.
        for preferred in (replicas[0], lease.holder):
            server = servers.get(preferred)
            if server is not None and server.running and preferred in isr:
                return Takeover(lease=lease, new_holder=preferred, reason=TakeoverReason.HOLDER_RESTARTED)
    else:
        # The holder runs and is ready, yet let its lease lapse (it stepped down when it
        # could not renew through an overloaded API server, and a server never takes a
        # lease back by itself), and no other in-sync replica is ready. It alone holds
        # every committed write, so it takes the lease again in a new epoch. Waiting left
        # such a shard unled for good, while the Shard still named its leader.
        holder = servers.get(lease.holder)
        if holder is not None and holder.ready and lease.holder in isr:
            return Takeover(lease=lease, new_holder=lease.holder, reason=TakeoverReason.LEASE_RETAKEN)
    return Waiting(lease=lease, reason=reason)


def choose_failovers(
    *, cluster: ClusterMap, leases: Mapping[str, LeaseRecord], servers: Mapping[str, ServerObservation], now_ms: int
) -> list[Takeover | Waiting]:
    """`choose_failover` for every shard of the cluster that has a lease, spreading the new leaders.

    Each server's load for the choice is its observed load plus LED_SHARD_LOAD per shard
    it leads, counting the takeovers decided earlier in the same pass: on an idle cluster
    every observed load is 0, and ties alone would pile all of a dead server's shards
    onto the first name.
    """
    led = dict.fromkeys(servers, 0)
    for held in leases.values():
        if held.holder in led:
            led[held.holder] += 1
    decisions: list[Takeover | Waiting] = []
    for shard in cluster.shards():
        lease = leases.get(lease_name(shard))
        if lease is None:
            continue
        weighted = {
            name: dataclasses.replace(server, load=server.load + LED_SHARD_LOAD * led[name])
            for name, server in servers.items()
        }
        decision = choose_failover(
            lease=lease, shard=shard, replicas=cluster.replicas_of(shard), servers=weighted, now_ms=now_ms
        )
        if decision is None:
            continue
        decisions.append(decision)
        if isinstance(decision, Takeover) and decision.new_holder != lease.holder:
            led[decision.new_holder] += 1
            if lease.holder in led:
                led[lease.holder] -= 1
    return decisions


def choose_rebalancing(
    *,
    cluster: ClusterMap,
    leases: Mapping[str, LeaseRecord],
    servers: Mapping[str, ServerObservation],
    shard_loads: Mapping[ShardId, float],
    now_ms: int,
    max_moves: int = 1,
    imbalance_threshold: float = IMBALANCE_THRESHOLD,
) -> list[Takeover]:
    """Leadership moves off a hot server, only while the cluster is settled.

    Settled means every server is ready and every lease is held by a live, renewing holder:
    while a failover is pending, loads are in flux and moving more leaders would only add
    hand-overs to it.
    """
    settled = _settled_state(cluster, leases, servers, shard_loads, now_ms)
    if settled is None:
        return []
    state, by_shard = settled
    moves = choose_leadership_moves(state, max_moves=max_moves, imbalance_threshold=imbalance_threshold)
    return [
        Takeover(lease=by_shard[move.shard], new_holder=move.to_server, reason=TakeoverReason.REBALANCE)
        for move in moves
    ]


def choose_replica_rebalancing(
    *,
    cluster: ClusterMap,
    leases: Mapping[str, LeaseRecord],
    servers: Mapping[str, ServerObservation],
    shard_loads: Mapping[ShardId, float],
    now_ms: int,
    imbalance_threshold: float = IMBALANCE_THRESHOLD,
) -> LeadershipMove | None:
    """A replica of a hot shard to add on a cooler server when moving leadership alone
    cannot cool the hottest one (`placement.choose_replica_move_for_load`), only while
    the cluster is settled (see `choose_rebalancing`). `replica_moves` carries it out."""
    settled = _settled_state(cluster, leases, servers, shard_loads, now_ms)
    if settled is None:
        return None
    return choose_replica_move_for_load(settled[0], imbalance_threshold=imbalance_threshold)


def _settled_state(
    cluster: ClusterMap,
    leases: Mapping[str, LeaseRecord],
    servers: Mapping[str, ServerObservation],
    shard_loads: Mapping[ShardId, float],
    now_ms: int,
) -> tuple[ClusterState, dict[ShardId, LeaseRecord]] | None:
    """The cluster as the rebalancing rules see it, or None while it is not settled or
    too idle for moves to be worth their hand-overs."""
    if not servers or not all(server.ready for server in servers.values()):
        return None
    shard_states: list[ShardState] = []
    by_shard: dict[ShardId, LeaseRecord] = {}
    for shard in cluster.shards():
        lease = leases.get(lease_name(shard))
        if lease is None or is_expired(lease, now_ms) or holder_incarnation_is_gone(lease, servers):
            return None
        by_shard[shard] = lease
        shard_states.append(
            ShardState(
                shard=shard,
                replicas=cluster.replicas_of(shard),
                leader=lease.holder,
                isr=isr_of(lease),
                load=shard_loads.get(shard, 0.0),
            )
        )
    state = ClusterState(
        servers=tuple(ServerState(name=name, load=server.load) for name, server in sorted(servers.items())),
        shards=tuple(shard_states),
    )
    if max(compute_leader_loads(state).values(), default=0.0) < MIN_LOAD_TO_REBALANCE:
        return None
    return state, by_shard


def isr_after_takeover(takeover: Takeover) -> frozenset[str]:
    """The ISR to write with a takeover.

    A holder that died or stopped renewing is acknowledging nothing: leaving it
    in the ISR would make the new leader wait for the lag timeout (about a
    second) before its first commit. Its data stays on disk; it rejoins the ISR
    once it has caught up. A move off a hot, healthy server keeps the ISR.
    """
    isr = isr_of(takeover.lease)
    old = takeover.lease.holder
    if takeover.reason in (TakeoverReason.HOLDER_DIED, TakeoverReason.LEASE_EXPIRED) and old != takeover.new_holder:
        return isr - {old}
    return isr
