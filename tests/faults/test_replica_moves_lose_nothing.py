"""Scaling out and in moves replicas between real servers while producers and consumers
run: three servers hold a 4-shard queue with 3 replicas each; two more join and the
replica-move plan (`shardq.coordination.replica_moves`, driven here exactly as the
operator drives it: write the map it returns, carry out its hand-offs as lease CAS)
spreads replicas onto them; then the plan drains them again, leadership handed off
first, and they stop. The history checker must pass: nothing acknowledged lost, nothing
deleted resurrected, one holder per message."""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Iterator, Sequence

import pytest

from shardq import Client
from shardq.coordination.cluster_map import read_cluster_map, write_cluster_map
from shardq.coordination.fencing import build_takeover, isr_of
from shardq.coordination.leases import LeaseConflict
from shardq.coordination.placement import ShardId
from shardq.coordination.replica_moves import MovePlan, plan_replica_moves, replica_counts
from tests.faults.checking import QueueSpec, check_history, format_violations
from tests.faults.history import History, Send, StoredMessage, dump_history
from tests.faults.workload import Workload, WorkloadConfig, read_stored
from tests.support.clusters import Cluster
from tests.support.servers import wait_for

FIRST = ("s1", "s2", "s3")
SPARE = ("s4", "s5")
PLACEMENT = [["s1", "s2", "s3"], ["s2", "s3", "s1"], ["s3", "s1", "s2"], ["s1", "s3", "s2"]]
PROGRESS_AFTER_STEP = 150
MOVES_DEADLINE_S = 90.0


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    local = Cluster(tmp_path / "cluster", placement=PLACEMENT, spare_servers=SPARE, lease_ms=1_500)
    try:
        yield local
    finally:
        local.stop_all()


def serving(cluster: Cluster, server: str) -> bool:
    try:
        with Client(cluster.endpoint(server), route_directly=False) as client:
            client.list_queues()
    except Exception:  # not up yet
        return False
    return True


def drive_moves(cluster: Cluster, servers: Sequence[str], *, running: Sequence[str]) -> list[MovePlan]:
    """Apply the plan until it settles, as the operator's reconcile does once a second."""
    plans: list[MovePlan] = []
    deadline = time.monotonic() + MOVES_DEADLINE_S
    while time.monotonic() < deadline:
        current = read_cluster_map(cluster.cluster_file)
        leases = {record.name: record for record in cluster.leases.list("")}
        plan = plan_replica_moves(cluster=current, servers=servers, ready=running, leases=leases)
        plans.append(plan)
        for handoff in plan.handoffs:
            taken = build_takeover(
                handoff.lease, new_holder=handoff.new_holder, now_ms=int(time.time() * 1000), duration_ms=1_500
            )
            with contextlib.suppress(LeaseConflict):  # renewed meanwhile: the next pass decides again
                cluster.leases.update(taken)
        if plan.cluster_map != current:
            write_cluster_map(cluster.cluster_file, plan.cluster_map)
        if plan.settled:
            return plans
        time.sleep(0.5)
    raise AssertionError(
        f"replica moves did not settle in {MOVES_DEADLINE_S} s; last plan waits on {plans[-1].waiting}"
    )


def wait_for_progress(workload: Workload, cluster: Cluster, *, after: str) -> None:
    start = workload.ok_operations()
    try:
        wait_for(
            lambda: workload.ok_operations() >= start + PROGRESS_AFTER_STEP,
            timeout=30,
            what=f"{PROGRESS_AFTER_STEP} acknowledged operations after {after}",
        )
    except AssertionError as error:
        logs = [cluster.root / f"{server}.log" for server in cluster.servers]
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        raise AssertionError(f"{error}\n{tails}") from None


def shard_directories(cluster: Cluster, server: str) -> list[str]:
    queue_dir = cluster.root / server / "queues" / "orders"
    return sorted(child.name for child in queue_dir.iterdir()) if queue_dir.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaling_out_and_back_in_moves_replicas_and_loses_nothing(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    for server in FIRST:
        cluster.start(server)
    for server in FIRST:
        wait_for(lambda server=server: serving(cluster, server), timeout=30, what=f"{server} serving")
    running = list(FIRST)
    history = History()
    config = WorkloadConfig(
        seed=7, producers=3, consumers=3, fifo_producers=0, fifo_consumers=0,
        messages_per_producer=3_000, send_duration_s=120.0,
    )  # fmt: skip
    workload = Workload(
        endpoints=lambda: [cluster.endpoint(server) for server in running], history=history, config=config
    )
    workload.start()
    path = tmp_path / "history.jsonl"
    final: list[StoredMessage] = []
    try:
        try:
            wait_for_progress(workload, cluster, after="start")

            # Scale out: two servers join and take their share of replicas.
            for server in SPARE:
                cluster.start(server)
            for server in SPARE:
                wait_for(lambda server=server: serving(cluster, server), timeout=30, what=f"{server} serving")
            running += SPARE
            plans = drive_moves(cluster, FIRST + SPARE, running=running)
            spread = replica_counts(read_cluster_map(cluster.cluster_file), FIRST + SPARE)
            assert min(spread.values()) >= 2, spread  # 12 replicas on 5 servers
            assert max(spread.values()) - min(spread.values()) <= 1, spread
            assert sum(len(plan.finished) for plan in plans) >= 4
            for server in SPARE:
                assert shard_directories(cluster, server), f"{server} holds no replica's data"
            # Each leader drops the replicas that moved away from the ISR once it reads the map.
            moved_on = read_cluster_map(cluster.cluster_file)
            wait_for(
                lambda: all(
                    isr_of(record) == set(moved_on.replicas_of(ShardId("orders", int(record.name.split(".")[1]))))
                    for record in cluster.leases.list("")
                ),
                timeout=10,
                what="every ISR to be exactly the shard's replicas",
            )
            wait_for_progress(workload, cluster, after="scaling out")

            # Scale in: the two leave again; whatever they lead is handed off first.
            plans = drive_moves(cluster, FIRST, running=running)
            after = read_cluster_map(cluster.cluster_file)
            assert set(replica_counts(after, FIRST)) == set(FIRST), replica_counts(after, FIRST)
            assert all(plan.handoffs == [] or plan.draining for plan in plans)
            for record in cluster.leases.list(""):
                assert record.holder in FIRST, f"{record.name} still led by {record.holder}"
            for server in SPARE:
                wait_for(
                    lambda server=server: not shard_directories(cluster, server),
                    timeout=10,
                    what=f"{server} to delete the replicas that moved away",
                )
            running[:] = list(FIRST)
            for server in SPARE:
                cluster.processes[server].terminate()
                cluster.processes.pop(server).wait(timeout=15)
            wait_for_progress(workload, cluster, after="scaling in")
            workload.stop_producing()
        finally:
            workload.stop()
        workload.drain(["orders"])
        final = read_stored([cluster.endpoint(server) for server in FIRST], ["orders"])
    finally:
        dump_history(history.operations(), path, final=final)
    operations = history.operations()
    violations = check_history(operations, final=final, queues=[QueueSpec("orders")])
    assert not violations, f"{len(violations)} violations; history in {path}\n{format_violations(violations)}"
    acknowledged_sends = sum(1 for o in operations if o.ok and isinstance(o, Send))
    assert acknowledged_sends > 300, f"only {acknowledged_sends} sends were acknowledged"
