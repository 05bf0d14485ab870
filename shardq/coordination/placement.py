"""Pure decisions about where shards live and who leads them: placement, failover, rebalancing.

Standard library only, no I/O and no clock: the operator and the local supervisor observe
the cluster, call these functions, and carry out what they return (a lease
compare-and-swap for a new leader), so both make the same decisions from the same facts.
Loads are in one unit chosen by the caller (e.g. operations per second); a server's leader
load is the sum of the loads of the shards it leads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class ShardId:
    queue: str
    index: int

    def __str__(self) -> str:
        return f"{self.queue}-{self.index}"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerState:
    """A shard server as observed: `live` when its process (pod) is up and ready.

    `hosted` counts the shard replicas it holds already; only initial placement reads it.
    """

    name: str
    live: bool = True
    load: float = 0.0
    hosted: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ShardState:
    """A shard as observed: where its replicas are, who leads, who is in sync, how busy it is."""

    shard: ShardId
    replicas: tuple[str, ...]
    leader: str | None
    isr: frozenset[str]
    load: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterState:
    servers: tuple[ServerState, ...]
    shards: tuple[ShardState, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Where a new shard's replicas go; `replicas[0]` is its first leader."""

    replicas: tuple[str, ...]

    @property
    def leader(self) -> str:
        return self.replicas[0]


@dataclasses.dataclass(frozen=True, slots=True)
class LeadershipMove:
    shard: ShardId
    from_server: str
    to_server: str


def choose_initial_placement(
    *, shards: Iterable[ShardId], replicas: int, servers: Iterable[ServerState]
) -> dict[ShardId, ShardPlacement]:
    """Replicas of each shard on distinct live servers, leaders and replicas spread evenly.

    Among the shards placed, every server leads, and hosts, as many as any other, give or
    take one; a shard's followers are the servers after its leader on the ring of live
    servers in name order. Where that ring starts decides which servers take the shards
    that cannot come out even: it starts where the chosen leaders have least load, then
    where the chosen replicas' servers host fewest replicas already (`ServerState.hosted`),
    then at the first name. So one-shard queues placed one after another take turns on
    every server. Deterministic: the same facts give the same placement whatever order
    they come in.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    candidates = sorted((server for server in servers if server.live), key=lambda server: server.name)
    if replicas > len(candidates):
        raise ValueError(f"{replicas} replicas need as many live servers, there are {len(candidates)}")
    names = [server.name for server in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be unique: {names}")
    ordered = sorted(set(shards))
    load = {server.name: server.load for server in candidates}
    hosted = {server.name: server.hosted for server in candidates}

    def weight(chosen: list[tuple[str, ...]]) -> tuple[float, int]:
        return (sum(load[run[0]] for run in chosen), sum(hosted[name] for run in chosen for name in run))

    rings = [names[start:] + names[:start] for start in range(len(names))]
    runs = min((_runs_on_the_ring(len(ordered), replicas, ring) for ring in rings), key=weight)
    return {shard: ShardPlacement(replicas=run) for shard, run in zip(ordered, runs, strict=True)}


def _runs_on_the_ring(shards: int, replicas: int, ring: list[str]) -> list[tuple[str, ...]]:
    """Each shard's leader and followers, a run of `replicas` servers on the ring.

    Leaders at floor(position * servers / shards) lead floor or ceil(shards / servers)
    shards each, and a run of `replicas` servers from each leader then covers every server
    floor or ceil(shards * replicas / servers) times: the leader positions form a maximally
    even set on the ring, and any arc holds as many of them as any other arc of its length,
    give or take one. (Stepping the leader by one per shard would pile the replicas of a
    last, partial round onto the first servers.)
    """
    runs = []
    for position in range(shards):
        leader = position * len(ring) // shards
        runs.append(tuple(ring[(leader + offset) % len(ring)] for offset in range(replicas)))
    return runs


def choose_failover_candidate(shard: ShardState, live_servers: Collection[ServerState]) -> str | None:
    """The replica to promote when the shard's leader failed, or None if none is safe.

    Only an in-sync replica holds every committed entry, so only an ISR member on a live
    server qualifies; promoting anyone else would lose acknowledged writes, and waiting
    (None) is the right answer then. The failed leader itself is never chosen. Among the
    candidates the least-loaded server wins, then the first by name.
    """
    candidates = [
        server
        for server in live_servers
        if server.live and server.name in shard.isr and server.name in shard.replicas and server.name != shard.leader
    ]
    if not candidates:
        return None
    return min(candidates, key=_coolest_first).name


def compute_leader_loads(cluster: ClusterState) -> dict[str, float]:
    """Per live server, the summed load of the shards it leads (0 for a server leading none)."""
    loads = {server.name: 0.0 for server in cluster.servers if server.live}
    for shard in cluster.shards:
        if shard.leader in loads:
            loads[shard.leader] += shard.load
    return loads


def choose_leadership_moves(
    cluster: ClusterState, *, max_moves: int = 1, imbalance_threshold: float
) -> list[LeadershipMove]:
    """Hand leadership of hot shards from the hottest server to in-sync followers on cooler ones.

    Balanced, and nothing moves, while the hottest live server's leader load is at most
    (1 + imbalance_threshold) times the mean over live servers. Otherwise the hottest
    server (first by name among equals) hands over the shard, to the follower, that makes
    max(its load after, the follower's load after) smallest, provided that is strictly
    below its load now: every move strictly lowers the higher load of the pair it
    touches, so moves never create a new hottest server and repeated calls settle
    instead of swapping a shard back and forth. At most one move per queue per call (a
    queue never has several shards between leaders at once), at most `max_moves` in all,
    only to an in-sync follower on a live server, never for a shard whose leader is dead
    (that is failover's work).
    """
    if imbalance_threshold < 0:
        raise ValueError(f"imbalance_threshold must not be negative, got {imbalance_threshold}")
    loads = compute_leader_loads(cluster)
    leaders = {shard.shard: shard.leader for shard in cluster.shards}
    moved_queues: set[str] = set()
    moves: list[LeadershipMove] = []
    while len(moves) < max_moves and loads:
        move = _choose_one_move(cluster, loads, leaders, moved_queues, imbalance_threshold)
        if move is None:
            break
        shard_load = _load_of(cluster, move.shard)
        loads[move.from_server] -= shard_load
        loads[move.to_server] += shard_load
        leaders[move.shard] = move.to_server
        moved_queues.add(move.shard.queue)
        moves.append(move)
    return moves


def _choose_one_move(
    cluster: ClusterState,
    loads: Mapping[str, float],
    leaders: Mapping[ShardId, str | None],
    moved_queues: Collection[str],
    imbalance_threshold: float,
) -> LeadershipMove | None:
    hottest = _hottest_above_threshold(loads, imbalance_threshold)
    if hottest is None:
        return None
    options = (
        (shard, follower)
        for shard in cluster.shards
        if leaders[shard.shard] == hottest and shard.shard.queue not in moved_queues and shard.load > 0
        for follower in shard.replicas
        if follower != hottest and follower in shard.isr and follower in loads
    )
    return _best_relief(loads, hottest, options)


def choose_replica_move_for_load(cluster: ClusterState, *, imbalance_threshold: float) -> LeadershipMove | None:
    """When moving leadership cannot cool the hottest server (each of its hot shards has
    no in-sync follower on a cooler server, or no follower at all), a replica of one of
    its shards to add on a cooler live server that holds none, which then takes the
    shard's leadership. Same rule as `choose_leadership_moves`: only while the hottest
    server is above (1 + imbalance_threshold) times the mean, and only a move that makes
    the higher of the two servers' loads strictly lower than the hottest's now. None when
    balanced, when a leadership move would do, or when no replica move helps."""
    if choose_leadership_moves(cluster, max_moves=1, imbalance_threshold=imbalance_threshold):
        return None
    loads = compute_leader_loads(cluster)
    hottest = _hottest_above_threshold(loads, imbalance_threshold)
    if hottest is None:
        return None
    options = (
        (shard, target)
        for shard in cluster.shards
        if shard.leader == hottest and shard.load > 0
        for target in loads
        if target not in shard.replicas
    )
    return _best_relief(loads, hottest, options)


def _hottest_above_threshold(loads: Mapping[str, float], imbalance_threshold: float) -> str | None:
    """The hottest server (first by name among equals), if its load is above (1 +
    imbalance_threshold) times the mean; None when balanced (or no server is live)."""
    if not loads:
        return None
    hottest = min(loads, key=lambda name: (-loads[name], name))
    mean = sum(loads.values()) / len(loads)
    return hottest if loads[hottest] > mean * (1 + imbalance_threshold) else None


def _best_relief(
    loads: Mapping[str, float], hottest: str, options: Iterable[tuple[ShardState, str]]
) -> LeadershipMove | None:
    """Of the (shard led by `hottest`, server to take it) options, the one leaving the
    lowest peak of the two servers' loads, if that is strictly below the hottest's now
    (ties: first shard, then first server)."""
    best: tuple[float, ShardId, str] | None = None
    for shard, target in options:
        peak_after = max(loads[hottest] - shard.load, loads[target] + shard.load)
        if peak_after >= loads[hottest]:
            continue
        candidate = (peak_after, shard.shard, target)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    _, shard_id, target = best
    return LeadershipMove(shard=shard_id, from_server=hottest, to_server=target)


def _load_of(cluster: ClusterState, shard_id: ShardId) -> float:
    return next(shard.load for shard in cluster.shards if shard.shard == shard_id)


def _coolest_first(server: ServerState) -> tuple[float, str]:
    return (server.load, server.name)


__all__ = [
    "ClusterState",
    "LeadershipMove",
    "ServerState",
    "ShardId",
    "ShardPlacement",
    "ShardState",
    "choose_failover_candidate",
    "choose_initial_placement",
    "choose_leadership_moves",
    "choose_replica_move_for_load",
    "compute_leader_loads",
]
