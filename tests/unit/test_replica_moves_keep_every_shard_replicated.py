"""Replica moves (scale-out, scale-in, balance) as a pure plan, driven step by step against
a simulated cluster: leaders admit a new replica to the ISR one step after it appears,
hand-offs land as lease CAS. At every step every shard keeps at least its replication
factor of in-sync replicas, a leader's replica never leaves while it leads, and the moves
end with every replica on the remaining servers, evenly spread."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from shardq.coordination.cluster_map import ClusterMap, QueueEntry, ServerEntry, lease_name, place_queues
from shardq.coordination.fencing import build_isr_change, build_takeover, isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.placement import ClusterState, ServerState, ShardId, ShardState, choose_replica_move_for_load
from shardq.coordination.replica_moves import ReplicaMove, plan_replica_moves, replica_counts
from shardq.coordination.takeovers import TakeoverReason, build_initial_lease


def servers(count: int) -> list[str]:
    return [f"s{index}" for index in range(count)]


def cluster_on(count: int, queues: list[QueueEntry]) -> ClusterMap:
    ids = servers(count)
    return ClusterMap(
        servers={server: ServerEntry(server, f"{server}:7000") for server in ids},
        queues=queues,
        placement=place_queues(queues, ids),
    )


def first_leases(cluster: ClusterMap) -> dict[str, LeaseRecord]:
    return {
        lease_name(shard): build_initial_lease(
            shard=shard, replicas=cluster.replicas_of(shard), now_ms=0, duration_ms=10_000
        )
        for shard in cluster.shards()
    }


def with_servers(cluster: ClusterMap, count: int) -> ClusterMap:
    ids = sorted(set(servers(count)) | set(cluster.servers))
    return dataclasses.replace(cluster, servers={server: ServerEntry(server, f"{server}:7000") for server in ids})


def leaders_admit_caught_up(cluster: ClusterMap, leases: dict[str, LeaseRecord]) -> dict[str, LeaseRecord]:
    """What the leaders do between two operator passes: a replica new in the map has
    caught up and joins the ISR; one dropped from the map leaves it."""
    admitted = {}
    for shard in cluster.shards():
        lease = leases[lease_name(shard)]
        replicas = set(cluster.replicas_of(shard))
        admitted[lease.name] = build_isr_change(lease, (isr_of(lease) | replicas) & replicas)
    return admitted


def drive(cluster: ClusterMap, leases: dict[str, LeaseRecord], remaining: list[str], *, steps: int = 200):  # type: ignore[no-untyped-def]
    factors = {queue.name: queue.config.replicas for queue in cluster.queues}
    history = []
    for _ in range(steps):
        plan = plan_replica_moves(cluster=cluster, servers=remaining, ready=set(cluster.servers), leases=leases)
        for handoff in plan.handoffs:
            assert handoff.reason is TakeoverReason.REPLICA_MOVE
            assert handoff.new_holder in isr_of(handoff.lease)
            taken = build_takeover(handoff.lease, new_holder=handoff.new_holder, now_ms=1, duration_ms=10_000)
            leases[taken.name] = taken
        for shard in plan.cluster_map.shards():
            replicas = plan.cluster_map.replicas_of(shard)
            lease = leases[lease_name(shard)]
            # Never fewer replicas than asked for, and nobody leaves while leading.
            assert len(set(replicas)) == len(replicas) >= factors[shard.queue]
            assert lease.holder in replicas, f"{lease.name}: leader {lease.holder} dropped from {replicas}"
            # The in-sync replicas that stay are at least the replication factor.
            assert len(isr_of(lease) & set(replicas)) >= factors[shard.queue]
        history.append(plan)
        cluster = plan.cluster_map
        leases = leaders_admit_caught_up(cluster, leases)
        if plan.settled:
            return cluster, leases, history
    raise AssertionError(f"replica moves did not settle in {steps} steps: {history[-1]}")


def orders_dlq_and_fifo() -> list[QueueEntry]:
    return [
        QueueEntry("orders", {"shards": 4, "replicas": 3}),
        QueueEntry("orders-dlq", {"shards": 1, "replicas": 3}),
        QueueEntry("payments", {"shards": 2, "replicas": 3, "fifo": True}),
    ]


def assert_spread(cluster: ClusterMap, remaining: list[str]) -> None:
    counts = replica_counts(cluster, remaining)
    assert set(counts) == set(remaining), f"replicas outside {remaining}: {counts}"
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_scaling_out_from_three_to_five_servers_spreads_replicas_onto_the_new_ones() -> None:
    cluster = cluster_on(3, orders_dlq_and_fifo())
    leases = first_leases(cluster)
    cluster, leases, history = drive(with_servers(cluster, 5), leases, servers(5))
    assert_spread(cluster, servers(5))
    assert replica_counts(cluster, servers(5))["s4"] >= 4  # 21 replicas on 5 servers
    assert all(len(plan.started) <= 4 for plan in history)


def test_scaling_in_from_five_to_three_drains_the_last_two_and_hands_their_leadership_off() -> None:
    cluster = cluster_on(5, orders_dlq_and_fifo())
    leases = first_leases(cluster)
    led_by_leaving = [name for name, lease in leases.items() if lease.holder in {"s3", "s4"}]
    assert led_by_leaving, "the test needs shards led by the servers that go"
    cluster, leases, history = drive(cluster, leases, servers(3))
    assert_spread(cluster, servers(3))
    assert not any(lease.holder in {"s3", "s4"} for lease in leases.values())
    assert sum(len(plan.handoffs) for plan in history) >= len(led_by_leaving)
    assert history[-1].draining == []
    # While anything was still on s3/s4, the plan said so (the StatefulSet waits for it).
    assert all(plan.draining for plan in history[:-1] if any(plan.waiting.values()))


def test_a_scale_in_that_cannot_finish_says_why() -> None:
    """Five replicas cannot live on three servers: the plan moves nothing and says so per
    shard, where it waited in silence (seen on the real node: `replicaMoves: []` for good)."""
    cluster = cluster_on(5, [QueueEntry("wide", {"shards": 2, "replicas": 5})])
    plan = plan_replica_moves(cluster=cluster, servers=servers(3), ready=servers(5), leases=first_leases(cluster))
    assert plan.started == []
    assert sorted(plan.draining) == ["s3", "s4"]
    assert sorted(plan.stuck) == ["wide.0", "wide.1"]
    assert all("5 replicas need as many servers" in why for why in plan.stuck.values()), plan.stuck
    assert not plan.settled


def test_a_balanced_cluster_moves_nothing() -> None:
    cluster = cluster_on(3, orders_dlq_and_fifo())
    plan = plan_replica_moves(cluster=cluster, servers=servers(3), ready=servers(3), leases=first_leases(cluster))
    assert plan.settled
    assert plan.cluster_map is cluster


def test_a_new_server_that_is_not_ready_gets_nothing_yet() -> None:
    cluster = with_servers(cluster_on(3, orders_dlq_and_fifo()), 4)
    plan = plan_replica_moves(cluster=cluster, servers=servers(4), ready=servers(3), leases=first_leases(cluster))
    assert plan.started == []
    assert plan.cluster_map is cluster


def test_a_copy_that_has_not_caught_up_keeps_every_old_replica() -> None:
    cluster = cluster_on(5, orders_dlq_and_fifo())
    leases = first_leases(cluster)
    first = plan_replica_moves(cluster=cluster, servers=servers(3), ready=servers(5), leases=leases)
    assert first.started
    # The leaders have not admitted the new replicas yet: nothing is dropped, however often asked.
    again = plan_replica_moves(cluster=first.cluster_map, servers=servers(3), ready=servers(5), leases=leases)
    assert (again.finished, again.handoffs, again.started) == ([], [], [])
    assert again.cluster_map == first.cluster_map
    assert all(reason.startswith("copying to") for reason in again.waiting.values())


def test_a_leaving_leader_with_no_ready_heir_waits() -> None:
    cluster = cluster_on(4, [QueueEntry("solo", {"shards": 1, "replicas": 2})])
    leases = first_leases(cluster)
    leader = leases["solo.0"].holder
    remaining = [server for server in servers(4) if server != leader]
    plan = plan_replica_moves(cluster=cluster, servers=remaining, ready=servers(4), leases=leases)
    assert len(plan.started) == 1
    admitted = leaders_admit_caught_up(plan.cluster_map, leases)
    # The new copy is in sync, but only the leaving leader's server is ready: nobody to hand to.
    stuck = plan_replica_moves(cluster=plan.cluster_map, servers=remaining, ready={leader}, leases=admitted)
    assert (stuck.handoffs, stuck.finished) == ([], [])
    assert "no ready in-sync replica" in stuck.waiting["solo.0"]
    assert stuck.cluster_map == plan.cluster_map
    # Once they are ready, leadership is handed over first, and only then does the replica go.
    moving = plan_replica_moves(cluster=plan.cluster_map, servers=remaining, ready=servers(4), leases=admitted)
    (handoff,) = moving.handoffs
    assert handoff.new_holder != leader
    assert moving.finished == []


@settings(max_examples=60, deadline=None)
@given(
    before=st.integers(min_value=1, max_value=6),
    after=st.integers(min_value=1, max_value=6),
    shards=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4),
    replicas=st.integers(min_value=1, max_value=3),
)
def test_any_scaling_settles_with_every_shard_replicated_and_spread(
    before: int, after: int, shards: list[int], replicas: int
) -> None:
    factor = min(replicas, before, after)
    queues = [QueueEntry(f"q{index}", {"shards": count, "replicas": factor}) for index, count in enumerate(shards)]
    cluster = with_servers(cluster_on(before, queues), after)
    cluster, _, _ = drive(cluster, first_leases(cluster), servers(after))
    assert_spread(cluster, servers(after))


def hot_state(placement: dict[str, list[str]], leaders: dict[str, str], loads: dict[str, float]) -> ClusterState:
    """Shards named `q.N`, each with its replicas (all in sync), leader and load."""
    servers = sorted({server for replicas in placement.values() for server in replicas} | {"s0", "s1", "s2"})
    return ClusterState(
        servers=tuple(ServerState(server) for server in servers),
        shards=tuple(
            ShardState(
                shard=ShardId("q", int(name.split(".")[1])),
                replicas=tuple(replicas),
                leader=leaders[name],
                isr=frozenset(replicas),
                load=loads.get(name, 0.0),
            )
            for name, replicas in placement.items()
        ),
    )


def test_two_hot_shards_on_one_server_without_followers_get_a_replica_on_an_idle_one() -> None:
    # Replication factor 1: leadership cannot move at all; s0 leads both hot shards.
    state = hot_state(
        {"q.0": ["s0"], "q.1": ["s1"], "q.2": ["s2"], "q.3": ["s0"]},
        {"q.0": "s0", "q.1": "s1", "q.2": "s2", "q.3": "s0"},
        {"q.0": 100.0, "q.3": 90.0},
    )
    move = choose_replica_move_for_load(state, imbalance_threshold=0.25)
    assert move is not None
    assert move.from_server == "s0"
    assert move.to_server in {"s1", "s2"}
    # Either shard leaves s0 with the other one: a peak of 100 instead of 190.
    assert move.shard in {ShardId("q", 0), ShardId("q", 3)}


def test_a_replica_move_is_not_proposed_when_moving_leadership_does_it_or_nothing_helps() -> None:
    followers_elsewhere = hot_state(
        {"q.0": ["s0", "s1"], "q.1": ["s0", "s2"]},
        {"q.0": "s0", "q.1": "s0"},
        {"q.0": 100.0, "q.1": 90.0},
    )
    assert choose_replica_move_for_load(followers_elsewhere, imbalance_threshold=0.25) is None
    one_hot_shard = hot_state({"q.0": ["s0"]}, {"q.0": "s0"}, {"q.0": 100.0})
    assert choose_replica_move_for_load(one_hot_shard, imbalance_threshold=0.25) is None
    balanced = hot_state(
        {"q.0": ["s0"], "q.1": ["s1"], "q.2": ["s2"]},
        {"q.0": "s0", "q.1": "s1", "q.2": "s2"},
        {"q.0": 50.0, "q.1": 50.0, "q.2": 50.0},
    )
    assert choose_replica_move_for_load(balanced, imbalance_threshold=0.25) is None


def test_a_requested_move_runs_to_the_end_and_leadership_follows_the_replica() -> None:
    queue = QueueEntry("q", {"shards": 4, "replicas": 1})
    cluster = ClusterMap(
        servers={server: ServerEntry(server, f"{server}:7000") for server in servers(3)},
        queues=[queue],
        placement={"q": [["s0"], ["s1"], ["s2"], ["s0"]]},
    )
    leases = first_leases(cluster)
    requested = [ReplicaMove(shard=ShardId("q", 3), source="s0", target="s1")]
    plan = plan_replica_moves(cluster=cluster, servers=servers(3), ready=servers(3), leases=leases, requested=requested)
    assert plan.started == requested
    assert plan.cluster_map.placement["q"][3] == ["s0", "s1"]
    # Asked again while it runs: nothing more starts.
    again = plan_replica_moves(
        cluster=plan.cluster_map, servers=servers(3), ready=servers(3), leases=leases, requested=requested
    )
    assert again.started == []
    cluster, leases, _ = drive(plan.cluster_map, leases, servers(3))
    assert cluster.placement["q"][3] == ["s1"]
    assert leases["q.3"].holder == "s1"
    assert replica_counts(cluster, servers(3)) == {"s0": 1, "s1": 2, "s2": 1}
