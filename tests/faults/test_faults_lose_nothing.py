"""Issue 4's proof: producers and consumers run against a 3-server local cluster while
it suffers a SIGKILLed leader, a SIGSTOPped leader that wakes up after losing its
leases, a follower killed and brought back with an empty disk, and a restart of
everything; the recorded history and the final state must satisfy the checker's
five properties (tests/faults/checking.py)."""

from __future__ import annotations

import pathlib
import random
import signal
from collections.abc import Iterator

import pytest

from shard_server.local.processes import process_is_alive
from tests.faults.checking import QueueSpec, check_history, format_violations
from tests.faults.cluster import ClusterStatus, LocalCluster
from tests.faults.history import History, Send, StoredMessage, dump_history
from tests.faults.workload import Workload, WorkloadConfig, read_stored
from tests.support.servers import wait_for

QUEUES = ("orders:shards=4,replicas=3", "fifo:fifo=true,shards=2,replicas=3")
CHECKED = (QueueSpec("orders"), QueueSpec("fifo", fifo=True))
# Acknowledged operations the workload must complete after each fault: the cluster serves again.
PROGRESS_AFTER_FAULT = 200
FAILOVER_DEADLINE_S = 30.0
REJOIN_DEADLINE_S = 60.0


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    local = LocalCluster(data_dir=tmp_path / "cluster", queues=QUEUES)
    try:
        yield local
    finally:
        local.cleanup()


def wait_for_progress(cluster: LocalCluster, workload: Workload, *, after: str) -> None:
    start = workload.ok_operations()
    wait_for(
        lambda: workload.ok_operations() >= start + PROGRESS_AFTER_FAULT,
        timeout=FAILOVER_DEADLINE_S,
        what=f"{PROGRESS_AFTER_FAULT} acknowledged operations after {after}\n{cluster.timeline()}\n{cluster.output()}",
    )
    cluster.note(f"workload progressed after {after}")


def failed_over(cluster: LocalCluster, before: ClusterStatus, victim: str) -> ClusterStatus | None:
    """The status once every shard `victim` led has a new leader on a newer epoch."""
    status = cluster.status()
    for shard in before.led_by(victim):
        now = status.shards[shard.lease]
        if now.leader in ("", victim) or now.epoch <= shard.epoch or now.lease_expired:
            return None
    return status


def kill_a_leader(cluster: LocalCluster, rng: random.Random) -> None:
    before = cluster.wait_healthy(what="before killing a leader")
    victim = rng.choice(sorted({shard.leader for shard in before.shards.values()}))
    pid = before.servers[victim].pid
    cluster.signal_server(victim, pid, signal.SIGKILL)
    wait_for(
        lambda: failed_over(cluster, before, victim),
        timeout=FAILOVER_DEADLINE_S,
        what=f"failover from the killed {victim}\n{cluster.timeline()}\n{cluster.output()}",
    )
    cluster.note(f"shards of {victim} failed over")
    status = cluster.wait_healthy(what=f"{victim} restarted", timeout=REJOIN_DEADLINE_S)
    assert status.servers[victim].pid != pid


def pause_a_leader(cluster: LocalCluster, rng: random.Random) -> None:
    before = cluster.wait_healthy(what="before pausing a leader")
    victim = rng.choice(sorted({shard.leader for shard in before.shards.values()}))
    pid = before.servers[victim].pid
    cluster.signal_server(victim, pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: failed_over(cluster, before, victim),
            timeout=FAILOVER_DEADLINE_S,
            what=f"failover from the paused {victim}\n{cluster.timeline()}\n{cluster.output()}",
        )
        cluster.note(f"shards of the paused {victim} failed over")
    finally:
        cluster.signal_server(victim, pid, signal.SIGCONT)
    status = cluster.wait_healthy(what=f"{victim} woke up", timeout=REJOIN_DEADLINE_S)
    # Paused, not dead: the same process serves again (as a follower, or after a move).
    assert status.servers[victim].pid == pid


def kill_a_follower_and_bring_it_back_empty(cluster: LocalCluster, rng: random.Random) -> None:
    before = cluster.wait_healthy(what="before killing a follower")
    fewest = min(len(before.led_by(s)) for s in before.servers)
    victim = rng.choice(sorted(s for s in before.servers if len(before.led_by(s)) == fewest))
    pid = before.servers[victim].pid
    # The supervisor restarts a dead server at once: hold it while the data goes.
    cluster.pause_supervisor()
    try:
        cluster.signal_server(victim, pid, signal.SIGKILL)
        wait_for(lambda: not process_is_alive(pid), timeout=10, what=f"{victim} (pid {pid}) to die")
        cluster.wipe_server_data(victim)
    finally:
        cluster.resume_supervisor()

    def rejoined() -> ClusterStatus | None:
        status = cluster.healthy()
        if status is None or status.servers[victim].pid == pid:
            return None
        replicated = [s for s in status.shards.values() if victim in s.replicas]
        return status if all(victim in s.isr for s in replicated) else None

    status = wait_for(
        rejoined,
        timeout=REJOIN_DEADLINE_S,
        what=f"the emptied {victim} back in every ISR it belongs to\n{cluster.timeline()}\n{cluster.output()}",
    )
    cluster.note(f"{victim} rejoined empty: {cluster.describe(status)}")


def restart_everything(cluster: LocalCluster) -> None:
    assert cluster.terminate() == 0, cluster.output()
    cluster.up()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_faults_lose_nothing(cluster: LocalCluster, tmp_path: pathlib.Path, seed: int) -> None:
    rng = random.Random(seed)
    cluster.up()
    history = History()
    # Producers would send for 90 s; the test stops them once the last fault is behind.
    config = WorkloadConfig(seed=seed, messages_per_producer=4_000, send_duration_s=90.0)
    workload = Workload(endpoints=cluster.endpoints, history=history, config=config)
    workload.start()
    path = tmp_path / "history.jsonl"
    final: list[StoredMessage] = []
    try:
        try:
            wait_for_progress(cluster, workload, after="start")
            for fault in (kill_a_leader, pause_a_leader, kill_a_follower_and_bring_it_back_empty):
                fault(cluster, rng)
                wait_for_progress(cluster, workload, after=fault.__name__)
            restart_everything(cluster)
            wait_for_progress(cluster, workload, after="restart_everything")
            workload.stop_producing()
        finally:
            workload.stop()
        cluster.note("workload stopped")
        names = [queue.name for queue in CHECKED]
        workload.drain(names)
        final = read_stored(cluster.endpoints(), names)
        cluster.note(f"drained; {len(final)} messages still stored")
    finally:
        # For the post-mortem, whatever happened.
        dump_history(history.operations(), path, final=final)
        (tmp_path / "timeline.txt").write_text(cluster.timeline() + "\n")
    operations = history.operations()
    violations = check_history(operations, final=final, queues=CHECKED)
    assert not violations, (
        f"{len(violations)} violations; history in {path}\n{format_violations(violations)}\n"
        f"--- timeline\n{cluster.timeline()}"
    )
    acknowledged_sends = sum(1 for o in operations if o.ok and isinstance(o, Send))
    assert acknowledged_sends > 200, f"only {acknowledged_sends} sends were acknowledged"
