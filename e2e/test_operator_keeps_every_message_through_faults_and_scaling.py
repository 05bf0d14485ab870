"""Issue 13's proof on the real node: producers and consumers (the fault suite's workload,
recording every call's outcome) run against a ShardqCluster while

1. the leader pod of a shard is deleted (its server hands leadership off on SIGTERM);
2. a leader's server process is SIGKILLed inside its container (the kubelet restarts it,
   the pod and its volume stay);
3. a leader's server is SIGKILLed and its pod deleted, and the operator SIGKILLed right
   after (mid-failover): a new operator process finishes the job;
4. the pods are replaced one at a time for a new pod template (resources), each stopping
   server handing its leadership off;
5. the servers scale 3 -> 5 (replicas move onto the new pods) and back to 3 (replicas
   move off, leadership handed off first, before the StatefulSet shrinks).

Afterwards the queues are drained and every shard exported, and the history checker must
find nothing: no acknowledged send lost, no delete resurrected, one holder per message,
FIFO order kept."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from e2e.crds import install_crds
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from e2e.processes import server_pid
from e2e.realnode import RunningNode
from e2e.rollouts import pod_uids, wait_every_pod_replaced
from e2e.test_operator_runs_queues_on_a_shardq_cluster import (
    GROUP,
    READY_S,
    VERSION,
    apply,
    create_cluster,
    get,
    queue_ready,
    shard_leaders,
)
from tests.faults.checking import QueueSpec, check_history, format_violations
from tests.faults.history import History, Send, StoredMessage, dump_history
from tests.faults.workload import Workload, WorkloadConfig, read_stored

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1200)]

CHECKED = (QueueSpec("orders"), QueueSpec("fifo", fifo=True))
PROGRESS_AFTER_FAULT = 100
FAILOVER_S = 60.0
SCALE_S = 300.0
SERVERS = "app.kubernetes.io/name=shardq-server,app.kubernetes.io/instance=main"


class Scenario:
    """The cluster under test and the operator process currently running it."""

    def __init__(self, real_node: RunningNode, namespace: str, root: pathlib.Path, api: client.ApiClient) -> None:
        self.info = real_node.info
        self.namespace = namespace
        self.root = root
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self._operators = contextlib.ExitStack()
        self.operator: subprocess.Popen[bytes] | None = None
        self.operators_started = 0
        self.notes: list[str] = []

    def start_operator(self) -> None:
        self.operators_started += 1
        log = self.root / f"operator-{self.operators_started}.log"
        self.operator = self._operators.enter_context(running_operator(self.info.kubeconfig, self.namespace, log))

    def close(self) -> None:
        self._operators.close()

    def note(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {text}")
        print(self.notes[-1], flush=True)

    def operator_logs(self) -> str:
        logs = sorted(self.root.glob("operator-*.log"))
        return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)

    def cluster(self) -> dict[str, Any]:
        found = get(self.api, self.namespace, "shardqclusters", "main")
        assert found is not None
        return found

    def condition(self, kind: str) -> str:
        conditions = self.cluster().get("status", {}).get("conditions", [])
        return next((c.get("status", "") for c in conditions if c.get("type") == kind), "")

    def pods(self) -> list[Any]:
        return [
            pod
            for pod in self.core.list_namespaced_pod(self.namespace, label_selector=SERVERS).items
            if pod.metadata.deletion_timestamp is None
        ]

    def ready_pods(self) -> list[str]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/name=shardq-server,app.kubernetes.io/instance=main"
        ).items
        return sorted(
            pod.metadata.name
            for pod in pods
            if pod.metadata.deletion_timestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        )

    def pod_endpoints(self) -> list[str]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/name=shardq-server,app.kubernetes.io/instance=main"
        ).items
        return sorted(f"{pod.status.pod_ip}:7600" for pod in pods if pod.status.pod_ip)

    def wait_settled(self, what: str, *, servers: int, timeout: float = SCALE_S) -> None:
        """Every queue Ready and in sync, the servers all ready, no replica moving."""

        def settled() -> bool:
            return (
                len(self.ready_pods()) == servers
                and self.condition("Ready") == "True"
                and self.condition("Progressing") == "False"
                and all(queue_ready(self.api, self.namespace, spec.name) for spec in CHECKED)
            )

        wait_for(settled, timeout=timeout, interval=1.0, what=what, explain=self.operator_logs)

    def wait_failed_over(self, queue: str, index: int, victim: str, epoch: int) -> str:
        def failed_over() -> str | None:
            leader, now = shard_leaders(self.api, self.namespace, queue).get(index, ("", 0))
            return leader if now > epoch and leader and leader != victim else None

        return wait_for(
            failed_over, timeout=FAILOVER_S, interval=0.2, what=f"{queue}.{index} failing over from {victim}"
        )

    def scale(self, servers: int) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "shardqclusters", "main", {"spec": {"servers": servers}}
        )


@pytest.fixture
def scenario(real_node: RunningNode, node_namespace: str, tmp_path: pathlib.Path) -> Iterator[Scenario]:
    with real_node.info.api_client() as api:
        running = Scenario(real_node, node_namespace, tmp_path, api)
        try:
            yield running
        finally:
            running.close()


def wait_for_progress(workload: Workload, scenario: Scenario, *, after: str) -> None:
    start = workload.ok_operations()
    wait_for(
        lambda: workload.ok_operations() >= start + PROGRESS_AFTER_FAULT,
        timeout=FAILOVER_S,
        interval=0.2,
        what=f"{PROGRESS_AFTER_FAULT} acknowledged operations after {after}",
        explain=scenario.operator_logs,
    )
    scenario.note(f"workload progressed after {after} ({workload.ok_operations()} acknowledged operations)")


def delete_a_leader_pod(scenario: Scenario) -> None:
    victim, epoch = shard_leaders(scenario.api, scenario.namespace, "orders")[0]
    scenario.core.delete_namespaced_pod(victim, scenario.namespace, grace_period_seconds=0)
    leader = scenario.wait_failed_over("orders", 0, victim, epoch)
    scenario.note(f"orders.0: pod {victim} deleted, {leader} leads")


def kill_a_leader_process(scenario: Scenario) -> None:
    victim, epoch = shard_leaders(scenario.api, scenario.namespace, "orders")[1]
    os.kill(server_pid(scenario.namespace, victim), signal.SIGKILL)
    leader = scenario.wait_failed_over("orders", 1, victim, epoch)
    scenario.note(f"orders.1: server process of {victim} SIGKILLed, {leader} leads")


def kill_the_operator_mid_failover(scenario: Scenario) -> None:
    victim, epoch = shard_leaders(scenario.api, scenario.namespace, "orders")[2]
    assert scenario.operator is not None
    # The server crashes first: a pod deleted with its server running would hand its
    # leadership off itself, and the failover must be the operators' to finish.
    os.kill(server_pid(scenario.namespace, victim), signal.SIGKILL)
    scenario.core.delete_namespaced_pod(victim, scenario.namespace, grace_period_seconds=0)
    scenario.operator.send_signal(signal.SIGKILL)
    scenario.operator.wait(timeout=10)
    scenario.note(f"orders.2: {victim} SIGKILLed, its pod deleted and the operator SIGKILLed")
    generation = scenario.apps.read_namespaced_stateful_set("main-shardq", scenario.namespace).metadata.generation
    scenario.start_operator()
    leader = scenario.wait_failed_over("orders", 2, victim, epoch)
    scenario.note(f"orders.2: the new operator made {leader} leader")
    # A new operator process applies the same pod template: no server restarts for it.
    after = scenario.apps.read_namespaced_stateful_set("main-shardq", scenario.namespace).metadata.generation
    assert after == generation, f"the StatefulSet changed ({generation} -> {after}) when only the operator restarted"


def roll_the_pods(scenario: Scenario) -> None:
    """A change that needs new pods (resources): the StatefulSet replaces them one at a
    time, and each stopping server hands its leadership off first."""
    before = pod_uids(scenario.pods())
    scenario.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        scenario.namespace,
        "shardqclusters",
        "main",
        {"spec": {"resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}},
    )

    wait_every_pod_replaced(
        scenario.apps,
        scenario.namespace,
        "main-shardq",
        scenario.pods,
        before,
        timeout=SCALE_S,
        explain=scenario.operator_logs,
    )
    scenario.note(f"the new pod template rolled out: all {len(before)} pods replaced by the rolling update")


FAULTS: tuple[Callable[[Scenario], None], ...] = (
    delete_a_leader_pod,
    kill_a_leader_process,
    kill_the_operator_mid_failover,
    roll_the_pods,
)


def test_faults_and_scaling_under_load_lose_nothing(scenario: Scenario, tmp_path: pathlib.Path) -> None:
    api, namespace = scenario.api, scenario.namespace
    install_crds(api)
    scenario.start_operator()
    create_cluster(api, namespace, scenario.info.shardq_image, rebalance={"mode": "off"})
    apply(api, namespace, "queues", "Queue", "orders", {"cluster": "main", "shards": 4, "replicas": 3})
    apply(api, namespace, "queues", "Queue", "fifo", {"cluster": "main", "shards": 2, "replicas": 3, "fifo": True})
    scenario.wait_settled("the queues Ready", servers=3, timeout=READY_S)
    service_ip = scenario.core.read_namespaced_service("main-shardq", namespace).spec.cluster_ip
    endpoint = f"{service_ip}:7600"

    history = History()
    config = WorkloadConfig(
        seed=13, producers=2, consumers=2, fifo_producers=1, fifo_consumers=1,
        messages_per_producer=20_000, send_duration_s=900.0, call_timeout_s=5.0, route_directly=False,
    )  # fmt: skip
    workload = Workload(endpoints=lambda: [endpoint], history=history, config=config)
    workload.start()
    path = tmp_path / "history.jsonl"
    final: list[StoredMessage] = []
    try:
        try:
            wait_for_progress(workload, scenario, after="start")
            for fault in FAULTS:
                fault(scenario)
                wait_for_progress(workload, scenario, after=fault.__name__)
                scenario.wait_settled(f"settled after {fault.__name__}", servers=3)

            scenario.scale(5)
            wait_for(
                lambda: scenario.condition("Progressing") == "True" or len(scenario.ready_pods()) == 5,
                timeout=60,
                what="the scale-out to begin",
            )
            scenario.wait_settled("replicas spread onto 5 servers", servers=5)
            placed = {
                server
                for shard in scenario.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "shards")["items"]
                for server in shard["spec"]["replicas"]
            }
            assert {"main-shardq-3", "main-shardq-4"} <= placed, f"no replica moved to the new pods: {placed}"
            scenario.note(f"scaled out: replicas on {sorted(placed)}")
            wait_for_progress(workload, scenario, after="scaling out to 5")

            scenario.scale(3)
            wait_for(
                lambda: client.AppsV1Api(api).read_namespaced_stateful_set("main-shardq", namespace).spec.replicas == 3,
                timeout=SCALE_S,
                interval=1.0,
                what="the StatefulSet shrunk once replicas moved off",
                explain=scenario.operator_logs,
            )
            scenario.wait_settled("back to 3 servers", servers=3)
            leaders = {
                leader for queue in ("orders", "fifo") for leader, _ in shard_leaders(api, namespace, queue).values()
            }
            assert leaders <= {"main-shardq-0", "main-shardq-1", "main-shardq-2"}, leaders
            scenario.note("scaled back in to 3")
            wait_for_progress(workload, scenario, after="scaling back in to 3")
            workload.stop_producing()
        finally:
            workload.stop()
        names = [spec.name for spec in CHECKED]
        workload.drain(names, timeout=120)
        final = read_stored(scenario.pod_endpoints(), names)
        scenario.note(f"drained; {len(final)} messages still stored")
    finally:
        dump_history(history.operations(), path, final=final)
        (tmp_path / "notes.txt").write_text("\n".join(scenario.notes) + "\n")
    operations = history.operations()
    violations = check_history(operations, final=final, queues=CHECKED)
    assert not violations, f"{len(violations)} violations; history in {path}\n{format_violations(violations)}"
    acknowledged = sum(1 for o in operations if o.ok and isinstance(o, Send))
    assert acknowledged > 500, f"only {acknowledged} sends were acknowledged"
    # Everything the operator did is visible as Events.
    reasons = {event.reason for event in scenario.core.list_namespaced_event(namespace).items}
    assert {"Failover", "ReplicaMoveStarted", "ReplicaMoveFinished"} <= reasons, reasons
    assert get(api, namespace, "shardqclusters", "main") is not None
