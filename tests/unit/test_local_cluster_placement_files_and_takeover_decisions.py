"""`shardq local` without processes: the cluster file it writes, the leases it creates, and
the takeovers it decides from observed facts (failover only to an in-sync replica on a
ready server, a new epoch for a restarted holder, leadership moves only when settled).

These need no server; the supervisor's behaviour with real processes is in
test_local_cluster_supervises_real_servers.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections import Counter

import lmdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard_server.local.cluster_files import (
    IMPORTED_SUFFIX,
    LMDB_LEASE_FILE,
    build_cluster_file,
    open_cluster_lease_store,
    parse_queue_argument,
    read_cluster_file,
    write_cluster_file,
)
from shard_server.local.supervising import ensure_shard_leases, read_shard_leases
from shardq.coordination.cluster_map import ClusterMap, cluster_map_to_json, lease_name
from shardq.coordination.fencing import build_isr_change, build_renewal, build_takeover, isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import (
    MIN_LOAD_TO_REBALANCE,
    ServerObservation,
    Takeover,
    TakeoverReason,
    Waiting,
    build_initial_lease,
    choose_failover,
    choose_failovers,
    choose_rebalancing,
)
from shardq.queues import queue_config_from_spec

T0 = 1_763_771_298_000
DURATION_MS = 2_000
ORDERS_0 = ShardId("orders", 0)


def three_server_cluster(*queues: str) -> ClusterMap:
    return build_cluster_file(
        queues=[parse_queue_argument(text) for text in queues or ("orders:shards=4,replicas=3",)],
        server_count=3,
        base_port=7601,
        metrics_base_port=9601,
        lease_duration_ms=DURATION_MS,
    )


def ready(name: str, *, started: int = T0 - 60_000, load: float = 0.0) -> ServerObservation:
    return ServerObservation(name=name, running=True, started_at_ms=started, ready_since_ms=started + 500, load=load)


def dead(name: str, *, started: int = T0 - 60_000) -> ServerObservation:
    return ServerObservation(name=name, running=False, started_at_ms=started)


def starting(name: str, *, started: int) -> ServerObservation:
    return ServerObservation(name=name, running=True, started_at_ms=started)


def observed(*servers: ServerObservation) -> dict[str, ServerObservation]:
    return {server.name: server for server in servers}


def lease(
    holder: str = "s1",
    *,
    isr: tuple[str, ...] = ("s1", "s2", "s3"),
    acquired: int = T0 - 30_000,
    renewed: int = T0,
    transitions: int = 3,
) -> LeaseRecord:
    record = LeaseRecord(
        name="orders.0",
        holder=holder,
        acquire_time_ms=acquired,
        renew_time_ms=renewed,
        duration_ms=DURATION_MS,
        transitions=transitions,
        version="7",
    )
    return build_isr_change(record, isr)


def decide(record: LeaseRecord, servers: dict[str, ServerObservation], now_ms: int = T0) -> Takeover | Waiting | None:
    return choose_failover(lease=record, shard=ORDERS_0, replicas=("s1", "s2", "s3"), servers=servers, now_ms=now_ms)


class TestClusterFile:
    def test_matches_the_contract_servers_read(self, tmp_path: pathlib.Path) -> None:
        cluster = three_server_cluster("orders:shards=4,replicas=3,visibility=5s", "audit")
        write_cluster_file(tmp_path, cluster)

        data = json.loads((tmp_path / "cluster.json").read_text())
        assert data["servers"]["s1"] == {"address": "127.0.0.1:7601", "metrics_address": "127.0.0.1:9601"}
        assert data["servers"]["s3"] == {"address": "127.0.0.1:7603", "metrics_address": "127.0.0.1:9603"}
        uids = [queue.pop("uid") for queue in data["queues"]]
        assert data["queues"] == [
            {"name": "orders", "spec": {"shards": "4", "replicas": "3", "visibility": "5s"}},
            {"name": "audit", "spec": {}},
        ]
        # Each queue's creation is named, so a server never takes a namesake's data as its.
        assert all(re.fullmatch(r"[0-9a-f]{32}", uid) for uid in uids)
        assert len(set(uids)) == 2
        assert data["lease_duration_ms"] == DURATION_MS
        assert [len(replicas) for replicas in data["placement"]["orders"]] == [3, 3, 3, 3]
        # orders' four shards are led by s1 twice and by s2 and s3 once each, so audit's one
        # shard goes to the first of the servers that lead least.
        assert data["placement"]["audit"] == [["s2"]]
        # Servers build their queue settings from the spec with the shared parser.
        assert queue_config_from_spec("orders", data["queues"][0]["spec"]).visibility_timeout_ms == 5_000

    def test_round_trips_through_the_file(self, tmp_path: pathlib.Path) -> None:
        cluster = three_server_cluster()
        write_cluster_file(tmp_path, cluster)
        assert cluster_map_to_json(read_cluster_file(tmp_path)) == cluster_map_to_json(cluster)

    def test_spreads_leaders_and_replicas_evenly(self) -> None:
        cluster = three_server_cluster("orders:shards=6,replicas=3", "billing:shards=3,replicas=2")
        for queue, shards in cluster.placement.items():
            leaders = Counter(replicas[0] for replicas in shards)
            assert max(leaders.values()) - min(leaders.values()) <= 1, queue
            assert all(len(set(replicas)) == len(replicas) for replicas in shards), queue

    def test_refuses_more_replicas_than_servers(self) -> None:
        with pytest.raises(ValueError, match="replicas"):
            three_server_cluster("orders:shards=2,replicas=4")

    def test_refuses_an_invalid_queue_setting_before_writing_anything(self) -> None:
        with pytest.raises(ValueError, match="unknown queue setting"):
            parse_queue_argument("orders:shards=2,colour=blue")

    def test_refuses_a_placement_that_names_an_unknown_server(self, tmp_path: pathlib.Path) -> None:
        data = cluster_map_to_json(three_server_cluster())
        data["placement"]["orders"][0] = ["s1", "s9", "s2"]
        (tmp_path / "cluster.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="distinct known servers"):
            read_cluster_file(tmp_path)


class TestLeaseCreation:
    def test_every_shard_gets_a_lease_held_by_its_placement_leader_in_epoch_1(self, tmp_path: pathlib.Path) -> None:
        cluster = three_server_cluster()
        with LocalLeaseStore(tmp_path / "leases") as store:
            created = ensure_shard_leases(store, cluster, now_ms=T0)
            leases = read_shard_leases(store, cluster)

        assert len(created) == 4
        for index, replicas in enumerate(cluster.placement["orders"]):
            record = leases[f"orders.{index}"]
            assert record.holder == replicas[0]
            assert record.transitions == 1
            assert (record.acquire_time_ms, record.renew_time_ms, record.duration_ms) == (T0, T0, DURATION_MS)
            assert isr_of(record) == frozenset(replicas)

    def test_existing_leases_are_kept_with_their_epochs(self, tmp_path: pathlib.Path) -> None:
        cluster = three_server_cluster()
        with LocalLeaseStore(tmp_path / "leases") as store:
            ensure_shard_leases(store, cluster, now_ms=T0)
            first = store.get("orders.0")
            assert first is not None
            moved = store.update(build_takeover(first, new_holder="s3", now_ms=T0 + 1, duration_ms=DURATION_MS))

            assert ensure_shard_leases(store, cluster, now_ms=T0 + 2) == []
            assert store.get("orders.0") == moved

    def test_an_older_clusters_lmdb_leases_are_imported_once_before_anything_else_reads_them(
        self, tmp_path: pathlib.Path
    ) -> None:
        """A cluster made by an older shardq kept its leases in leases.lmdb: `up` must carry
        their epochs over, or ensure_shard_leases would start every shard again at epoch 1."""
        cluster = three_server_cluster()
        old_file = tmp_path / LMDB_LEASE_FILE
        environment = lmdb.open(str(old_file), subdir=False, max_dbs=0)
        with environment.begin(write=True) as txn:
            for index in range(4):
                old = {"format": 1, "holder": "s2", "transitions": 5 + index, "annotations": {}, "version": 9}
                old |= {"acquire_time_ms": T0, "renew_time_ms": T0, "duration_ms": DURATION_MS}
                txn.put(f"orders.{index}".encode(), json.dumps(old).encode())
        environment.close()

        store, imported = open_cluster_lease_store(tmp_path)
        with store:
            assert imported == 4
            assert ensure_shard_leases(store, cluster, now_ms=T0 + 1) == []
            leases = read_shard_leases(store, cluster)
        assert {name: (lease.holder, lease.transitions) for name, lease in leases.items()} == {
            f"orders.{index}": ("s2", 5 + index) for index in range(4)
        }
        assert not old_file.exists()
        assert (tmp_path / (LMDB_LEASE_FILE + IMPORTED_SUFFIX)).is_file()
        again, imported_again = open_cluster_lease_store(tmp_path)
        with again:
            assert imported_again == 0
            assert read_shard_leases(again, cluster) == leases

    def test_initial_lease_names_the_shard_as_servers_look_it_up(self) -> None:
        record = build_initial_lease(shard=ShardId("orders", 3), replicas=("s2", "s3"), now_ms=T0, duration_ms=1)
        assert record.name == lease_name(ShardId("orders", 3)) == "orders.3"


class TestFailover:
    def test_nothing_happens_while_the_holder_runs_and_renews(self) -> None:
        assert decide(lease(), observed(ready("s1"), ready("s2"), ready("s3"))) is None

    def test_dead_holder_hands_over_to_the_least_loaded_in_sync_replica(self) -> None:
        decision = decide(lease(), observed(dead("s1"), ready("s2", load=50), ready("s3", load=10)))
        assert decision == Takeover(lease=lease(), new_holder="s3", reason=TakeoverReason.HOLDER_DIED)

    def test_a_replica_outside_the_isr_is_never_promoted(self) -> None:
        record = lease(isr=("s1", "s2"))
        decision = decide(record, observed(dead("s1"), dead("s2"), ready("s3")))
        assert decision == Waiting(lease=record, reason=TakeoverReason.HOLDER_DIED)

    def test_a_starting_server_is_not_promoted_while_a_ready_one_is_in_sync(self) -> None:
        decision = decide(lease(), observed(dead("s1"), starting("s2", started=T0 - 100), ready("s3")))
        assert isinstance(decision, Takeover)
        assert decision.new_holder == "s3"

    def test_a_restarted_holder_does_not_keep_its_old_epoch(self) -> None:
        # Same name, new process: the lease it held belongs to the process that died.
        record = lease(acquired=T0 - 30_000)
        decision = decide(record, observed(ready("s1", started=T0 - 1_000), ready("s2"), ready("s3")))
        assert isinstance(decision, Takeover)
        assert decision.reason is TakeoverReason.HOLDER_DIED
        assert decision.new_holder in {"s2", "s3"}

    def test_the_restarted_holder_leads_again_in_a_new_epoch_when_it_is_the_only_one_in_sync(self) -> None:
        record = lease(isr=("s1",))
        decision = decide(record, observed(starting("s1", started=T0 - 100), ready("s2"), ready("s3")))
        assert decision == Takeover(lease=record, new_holder="s1", reason=TakeoverReason.HOLDER_RESTARTED)

    def test_a_lease_younger_than_its_holders_process_is_left_alone(self) -> None:
        # The supervisor creates leases right after starting the servers.
        record = lease(acquired=T0 - 10, renewed=T0 - 10)
        assert decide(record, observed(starting("s1", started=T0 - 20), dead("s2"), dead("s3"))) is None

    def test_a_holder_that_stopped_renewing_loses_the_lease_once_it_expired(self) -> None:
        record = lease(renewed=T0 - DURATION_MS)
        decision = decide(record, observed(ready("s1"), ready("s2"), ready("s3", load=5)))
        assert decision == Takeover(lease=record, new_holder="s2", reason=TakeoverReason.LEASE_EXPIRED)

    def test_an_unexpired_lease_is_never_taken_from_a_running_holder(self) -> None:
        record = lease(renewed=T0 - DURATION_MS + 1)
        assert decide(record, observed(ready("s1"), ready("s2"), ready("s3"))) is None

    def test_a_holder_still_starting_up_is_given_time_to_renew(self) -> None:
        record = lease(acquired=T0 - 10_000, renewed=T0 - 10_000)
        just_ready = ServerObservation(name="s1", running=True, started_at_ms=T0 - 20_000, ready_since_ms=T0 - 100)
        assert decide(record, observed(just_ready, ready("s2"), ready("s3"))) is None
        assert decide(record, observed(starting("s1", started=T0 - 20_000), ready("s2"), ready("s3"))) is None

    def test_a_holder_that_was_ready_and_stopped_answering_loses_the_expired_lease(self) -> None:
        # A paused (SIGSTOP) or hung holder fails its readiness checks as it fails to renew.
        record = lease(renewed=T0 - DURATION_MS)
        paused = dataclasses.replace(ready("s1"), ready_since_ms=None, unready_since_ms=T0 - 1_000)
        decision = decide(record, observed(paused, ready("s2"), ready("s3", load=5)))
        assert decision == Takeover(lease=record, new_holder="s2", reason=TakeoverReason.LEASE_EXPIRED)
        # Not before its lease has expired, however long it has been unready.
        assert decide(lease(renewed=T0 - DURATION_MS + 1), observed(paused, ready("s2"), ready("s3"))) is None

    def test_an_expired_lease_with_no_ready_in_sync_replica_waits(self) -> None:
        record = lease(renewed=T0 - DURATION_MS, isr=("s1", "s2"))
        paused = dataclasses.replace(ready("s1"), ready_since_ms=None, unready_since_ms=T0 - 1_000)
        assert decide(record, observed(paused, dead("s2"), ready("s3"))) == Waiting(
            lease=record, reason=TakeoverReason.LEASE_EXPIRED
        )

    def test_a_ready_holder_that_let_its_lease_lapse_takes_it_again_when_nobody_else_is_in_sync(self) -> None:
        # It stepped down when it could not renew (an API server too loaded to answer in
        # time) and takes no lease back by itself: waiting left the shard unled for good.
        record = lease(renewed=T0 - DURATION_MS, isr=("s1",))
        decision = decide(record, observed(ready("s1"), ready("s2"), ready("s3")))
        assert decision == Takeover(lease=record, new_holder="s1", reason=TakeoverReason.LEASE_RETAKEN)
        # Another in-sync replica that is ready is preferred, as before.
        record = lease(renewed=T0 - DURATION_MS, isr=("s1", "s2"))
        decision = decide(record, observed(ready("s1"), ready("s2"), ready("s3")))
        assert decision == Takeover(lease=record, new_holder="s2", reason=TakeoverReason.LEASE_EXPIRED)

    def test_every_shard_led_by_a_dead_server_fails_over(self) -> None:
        cluster = three_server_cluster()
        leases = {
            lease_name(shard): dataclasses.replace(
                build_initial_lease(
                    shard=shard, replicas=cluster.replicas_of(shard), now_ms=T0 - 5_000, duration_ms=DURATION_MS
                ),
                version="1",
            )
            for shard in cluster.shards()
        }
        servers = observed(dead("s1"), ready("s2"), ready("s3"))
        decisions = choose_failovers(cluster=cluster, leases=leases, servers=servers, now_ms=T0 - 4_000)

        led_by_s1 = {name for name, record in leases.items() if record.holder == "s1"}
        assert len(led_by_s1) == 2
        assert {decision.lease.name for decision in decisions} == led_by_s1
        # Idle servers tie on load: the two orphaned shards still go to different servers.
        assert {decision.new_holder for decision in decisions if isinstance(decision, Takeover)} == {"s2", "s3"}

    def test_a_restarted_cluster_gives_each_shard_back_to_its_placement_leader(self) -> None:
        # Every process is new and none is ready yet; the holder was s2 after an old failover.
        record = lease(holder="s2")
        servers = observed(*(starting(name, started=T0 - 100) for name in ("s1", "s2", "s3")))
        assert decide(record, servers) == Takeover(
            lease=record, new_holder="s1", reason=TakeoverReason.HOLDER_RESTARTED
        )


SERVER_NAMES = ("s1", "s2", "s3")


@st.composite
def server_observations(draw: st.DrawFn) -> dict[str, ServerObservation]:
    servers = {}
    for name in SERVER_NAMES:
        running = draw(st.booleans())
        started = draw(st.integers(T0 - 60_000, T0))
        ready_since = draw(st.one_of(st.none(), st.integers(started, T0))) if running else None
        load = draw(st.floats(0, 1_000))
        servers[name] = ServerObservation(
            name=name, running=running, started_at_ms=started, ready_since_ms=ready_since, load=load
        )
    return servers


@given(
    servers=server_observations(),
    holder=st.sampled_from(SERVER_NAMES),
    others_in_sync=st.sets(st.sampled_from(SERVER_NAMES)),
    acquired=st.integers(T0 - 60_000, T0),
    renewed=st.integers(T0 - 60_000, T0),
)
def test_failover_never_hands_a_shard_to_a_replica_out_of_sync_or_not_running(
    servers: dict[str, ServerObservation], holder: str, others_in_sync: set[str], acquired: int, renewed: int
) -> None:
    renewed = max(acquired, renewed)
    record = lease(holder, isr=(holder, *others_in_sync), acquired=acquired, renewed=renewed)
    decision = decide(record, servers)
    if isinstance(decision, Takeover):
        chosen = servers[decision.new_holder]
        assert decision.new_holder in isr_of(record)
        assert chosen.running
        # Only a ready server takes over from a live holder, and never the holder itself
        # unless no other in-sync replica is ready.
        if decision.reason is not TakeoverReason.HOLDER_RESTARTED:
            assert chosen.ready
        if decision.reason is TakeoverReason.LEASE_RETAKEN:
            assert decision.new_holder == holder
            assert not any(servers[other].ready for other in isr_of(record) - {holder})
        elif decision.reason is not TakeoverReason.HOLDER_RESTARTED:
            assert decision.new_holder != holder
    holder_process = servers[holder]
    if holder_process.running and holder_process.started_at_ms <= acquired and renewed > T0 - DURATION_MS:
        assert decision is None  # a live holder's unexpired lease is never taken


class TestRebalancing:
    def settled(self, cluster: ClusterMap) -> dict[str, LeaseRecord]:
        leases = {}
        for shard in cluster.shards():
            record = build_initial_lease(
                shard=shard, replicas=cluster.replicas_of(shard), now_ms=T0 - 1_000, duration_ms=DURATION_MS
            )
            leases[lease_name(shard)] = build_renewal(record, now_ms=T0)
        return leases

    def test_moves_one_hot_shard_to_an_in_sync_follower(self) -> None:
        cluster = three_server_cluster("orders:shards=3,replicas=3")
        leases = self.settled(cluster)
        hot = ShardId("orders", 0)
        hot_leader = leases["orders.0"].holder
        servers = observed(ready("s1"), ready("s2"), ready("s3"))

        moves = choose_rebalancing(cluster=cluster, leases=leases, servers=servers, shard_loads={hot: 900.0}, now_ms=T0)
        assert moves == []  # one shard carries all the load: moving it only moves the hot spot

        loads = {hot: 600.0, ShardId("orders", 1): 10.0, ShardId("orders", 2): 10.0}
        # Give the hot leader a second busy shard so that handing one over helps.
        leases["orders.1"] = dataclasses.replace(leases["orders.1"], holder=hot_leader)
        loads[ShardId("orders", 1)] = 500.0
        moves = choose_rebalancing(cluster=cluster, leases=leases, servers=servers, shard_loads=loads, now_ms=T0)

        assert len(moves) == 1
        assert moves[0].reason is TakeoverReason.REBALANCE
        assert moves[0].lease.holder == hot_leader
        assert moves[0].new_holder != hot_leader
        assert moves[0].new_holder in isr_of(moves[0].lease)

    def test_nothing_moves_while_a_server_is_down_or_a_lease_is_expired(self) -> None:
        cluster = three_server_cluster("orders:shards=3,replicas=3")
        leases = self.settled(cluster)
        leader = leases["orders.0"].holder
        leases["orders.1"] = dataclasses.replace(leases["orders.1"], holder=leader)
        loads = {ShardId("orders", 0): 600.0, ShardId("orders", 1): 500.0}
        everyone_ready = observed(ready("s1"), ready("s2"), ready("s3"))
        one_dead = {**everyone_ready, "s3": dead("s3")}

        assert choose_rebalancing(cluster=cluster, leases=leases, servers=one_dead, shard_loads=loads, now_ms=T0) == []
        expired_at = T0 + DURATION_MS
        assert (
            choose_rebalancing(
                cluster=cluster, leases=leases, servers=everyone_ready, shard_loads=loads, now_ms=expired_at
            )
            == []
        )

    def test_an_idle_cluster_is_left_alone(self) -> None:
        cluster = three_server_cluster("orders:shards=3,replicas=3")
        leases = self.settled(cluster)
        leader = leases["orders.0"].holder
        leases["orders.1"] = dataclasses.replace(leases["orders.1"], holder=leader)
        tiny = MIN_LOAD_TO_REBALANCE / 4
        loads = {ShardId("orders", 0): tiny, ShardId("orders", 1): tiny}
        servers = observed(ready("s1"), ready("s2"), ready("s3"))
        assert choose_rebalancing(cluster=cluster, leases=leases, servers=servers, shard_loads=loads, now_ms=T0) == []


def test_a_dead_or_silent_holder_leaves_the_isr_with_the_takeover() -> None:
    from shardq.coordination.fencing import build_isr_change
    from shardq.coordination.leases import LeaseRecord
    from shardq.coordination.takeovers import Takeover, TakeoverReason, isr_after_takeover

    lease = build_isr_change(LeaseRecord(name="orders.0", holder="s1", transitions=3), {"s1", "s2", "s3"})
    for reason in (TakeoverReason.HOLDER_DIED, TakeoverReason.LEASE_EXPIRED):
        assert isr_after_takeover(Takeover(lease, "s2", reason)) == {"s2", "s3"}
    # A healthy holder handing over stays in sync, and so does a holder taking its lease back.
    assert isr_after_takeover(Takeover(lease, "s2", TakeoverReason.REBALANCE)) == {"s1", "s2", "s3"}
    assert isr_after_takeover(Takeover(lease, "s1", TakeoverReason.HOLDER_RESTARTED)) == {"s1", "s2", "s3"}
