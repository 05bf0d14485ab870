"""Pure decisions for moving replicas between servers: after a scale-out, before a scale-in.

No I/O and no clock. The caller (the operator) reads the cluster map, the shard leases and
which servers are ready, calls `plan_replica_moves`, writes the map it returns and carries
out its hand-offs as lease compare-and-swaps; the next call continues from what it sees.

A move of one replica of a shard from `source` to `target` is three steps, each visible
in the map and the lease, so a restarted operator (or its standby) picks it up where it
was left:

1. `target` is appended to the shard's replicas: the shard has one replica more than its
   queue asks for. The leader starts shipping to it (a snapshot first); it is not in the
   ISR, so it can neither be promoted nor hold up commits.
2. Once the leader has admitted `target` to the ISR (it holds every entry), one replica
   leaves: one on a server that is going away if any, else one on the fullest server. If
   that replica leads, leadership is handed to another in-sync replica first.
3. The replica is dropped from the map: its server deletes its copy, and the leader stops
   counting it (an ISR shrink is always safe; the promoted replica holds every commit).

At every moment the shard has at least as many in-sync replicas as its queue asks for,
so no acknowledged message depends on the replica that leaves.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.fencing import isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import Takeover, TakeoverReason

# Shards copying to a new replica at once: each copy is a snapshot plus a log catch-up
# on the target, so a few at a time keeps the servers serving while they move.
DEFAULT_MAX_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaMove:
    shard: ShardId
    source: str  # "" while not chosen yet (the replica that leaves is picked once the new one is in sync)
    target: str


@dataclasses.dataclass(frozen=True, slots=True)
class MovePlan:
    # The map to write now (the input map when nothing changes).
    cluster_map: ClusterMap
    # Leadership to hand over (lease CAS) before a leading replica can leave.
    handoffs: list[Takeover]
    started: list[ReplicaMove]
    finished: list[ReplicaMove]
    # lease name -> why that shard's move is not finished yet.
    waiting: dict[str, str]
    # Servers still holding replicas that must go (scale-in not done while non-empty).
    draining: list[str]
    # lease name -> why its replica cannot leave a server that goes (no server to take it).
    stuck: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def settled(self) -> bool:
        """Nothing is moving and nothing needs to."""
        return not (self.handoffs or self.started or self.finished or self.waiting or self.draining)


def replication_factors(cluster: ClusterMap) -> dict[str, int]:
    return {queue.name: queue.config.replicas for queue in cluster.queues}


def replica_counts(cluster: ClusterMap, servers: Collection[str]) -> Counter[str]:
    """Replicas per server, every one of `servers` included (with 0)."""
    counts: Counter[str] = Counter(dict.fromkeys(servers, 0))
    for shards in cluster.placement.values():
        for replicas in shards:
            counts.update(replicas)
    return counts


def plan_replica_moves(
    *,
    cluster: ClusterMap,
    servers: Sequence[str],
    ready: Collection[str],
    leases: Mapping[str, LeaseRecord],
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    requested: Sequence[ReplicaMove] = (),
) -> MovePlan:
    """The next step towards every replica living on `servers`, spread evenly.

    `servers` are the servers that will remain (the StatefulSet's pods after scaling);
    `cluster.servers` may hold more (pods still to drain). Replicas only move to ready
    servers, and a shard whose lease is missing or whose leader is not ready waits
    (failover comes first). `requested` moves (a hot shard's replica onto a cooler
    server, `takeovers.choose_replica_rebalancing`) start first when they still can.
    """
    factors = replication_factors(cluster)
    staying = set(servers)
    placement = {queue: [list(replicas) for replicas in shards] for queue, shards in cluster.placement.items()}
    handoffs: list[Takeover] = []
    started: list[ReplicaMove] = []
    finished: list[ReplicaMove] = []
    waiting: dict[str, str] = {}
    stuck: dict[str, str] = {}
    counts = replica_counts(cluster, servers)

    # 1. Shards in the middle of a move: finish what can be finished.
    moving = 0
    for shard in cluster.shards():
        replicas = placement[shard.queue][shard.index]
        if len(replicas) <= factors.get(shard.queue, len(replicas)):
            continue
        name = lease_name(shard)
        lease = leases.get(name)
        newcomer = replicas[-1]
        isr = isr_of(lease) if lease is not None else frozenset()
        if lease is None or newcomer not in isr:
            moving += 1
            waiting[name] = f"copying to {newcomer}"
            continue
        leaving = _replica_to_drop(replicas[:-1], staying, counts)
        if leaving == lease.holder:
            moving += 1
            heir = _heir(lease, replicas, leaving, ready, counts)
            if heir is None:
                waiting[name] = f"no ready in-sync replica to take leadership from {leaving}"
            else:
                handoffs.append(Takeover(lease=lease, new_holder=heir, reason=TakeoverReason.REPLICA_MOVE))
                waiting[name] = f"handing leadership from {leaving} to {heir}"
            continue
        replicas.remove(leaving)
        counts[leaving] -= 1
        finished.append(ReplicaMove(shard=shard, source=leaving, target=newcomer))

    # 2. New moves, while fewer than max_in_flight shards are moving: the requested ones,
    #    then off the servers that go, then from the fullest to the emptiest server.
    targets = sorted(server for server in servers if server in ready)
    for move in requested:
        shards = placement.get(move.shard.queue, [])
        if moving >= max_in_flight or move.shard.index >= len(shards) or move.target not in targets:
            continue
        replicas = shards[move.shard.index]
        if len(replicas) > factors.get(move.shard.queue, len(replicas)) or move.target in replicas:
            continue  # moving already, or there already
        replicas.append(move.target)
        counts[move.target] += 1
        moving += 1
        started.append(move)
        waiting[lease_name(move.shard)] = f"copying to {move.target} (load)"
    for shard, source in _wanted_moves(cluster, placement, staying, factors, counts, targets, leases, ready):
        if moving >= max_in_flight:
            break
        replicas = placement[shard.queue][shard.index]
        if len(replicas) > factors.get(shard.queue, len(replicas)):
            continue  # its move started in this pass
        candidates = [server for server in targets if server not in replicas]
        if not candidates:
            if source not in staying:
                # A scale-in that cannot finish: say why, or it waits in silence for good.
                stuck[lease_name(shard)] = (
                    f"cannot leave {source}: every ready server that stays holds a replica already "
                    f"({factors.get(shard.queue, len(replicas))} replicas need as many servers)"
                )
            continue
        target = min(candidates, key=lambda server: (counts[server], server))
        if source in staying and counts[source] - counts[target] <= 1:
            continue  # balanced enough: moving would only swap the imbalance around
        replicas.append(target)
        counts[target] += 1
        moving += 1
        started.append(ReplicaMove(shard=shard, source=source, target=target))
        waiting[lease_name(shard)] = f"copying to {target}"

    draining = sorted({server for shards in placement.values() for replicas in shards for server in replicas} - staying)
    new_map = dataclasses.replace(cluster, placement=placement)
    return MovePlan(
        cluster_map=new_map if placement != cluster.placement else cluster,
        handoffs=handoffs,
        started=started,
        finished=finished,
        waiting=waiting,
        draining=draining,
        stuck=stuck,
    )


def _replica_to_drop(old: Sequence[str], staying: Collection[str], counts: Mapping[str, int]) -> str:
    """Of a shard's replicas before the move, the one that leaves: one on a server that
    goes away, else the one on the server holding the most replicas (last name on ties)."""
    going = [server for server in old if server not in staying]
    if going:
        return going[0]
    return max(old, key=lambda server: (counts[server], server))


def _heir(
    lease: LeaseRecord, replicas: Sequence[str], leaving: str, ready: Collection[str], counts: Mapping[str, int]
) -> str | None:
    """The in-sync replica on a ready server that takes leadership from `leaving`."""
    isr = isr_of(lease)
    candidates = [server for server in replicas if server != leaving and server in isr and server in ready]
    if not candidates:
        return None
    return min(candidates, key=lambda server: (counts[server], server))


def _wanted_moves(
    cluster: ClusterMap,
    placement: Mapping[str, list[list[str]]],
    staying: Collection[str],
    factors: Mapping[str, int],
    counts: Mapping[str, int],
    targets: Sequence[str],
    leases: Mapping[str, LeaseRecord],
    ready: Collection[str],
) -> list[tuple[ShardId, str]]:
    """(shard, replica's server) pairs worth moving, most needed first; only shards that
    are not moving already and whose leader is ready (so it can ship to the new replica)."""
    if not targets:
        return []
    settled = []
    for shard in cluster.shards():
        replicas = placement[shard.queue][shard.index]
        lease = leases.get(lease_name(shard))
        if len(replicas) > factors.get(shard.queue, len(replicas)) or lease is None or lease.holder not in ready:
            continue
        settled.append((shard, replicas))
    off_leaving = [(shard, server) for shard, replicas in settled for server in replicas if server not in staying]
    fullest = sorted(
        ((shard, server) for shard, replicas in settled for server in replicas if server in staying),
        key=lambda pair: (-counts[pair[1]], pair[1] == _leader(leases, pair[0]), pair[0].queue, pair[0].index),
    )
    return off_leaving + fullest


def _leader(leases: Mapping[str, LeaseRecord], shard: ShardId) -> str:
    lease = leases.get(lease_name(shard))
    return lease.holder if lease is not None else ""
