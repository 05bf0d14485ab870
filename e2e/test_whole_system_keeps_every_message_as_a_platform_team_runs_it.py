"""Issue 14's whole-system scenario on the real node, as a platform team runs shardq before
trusting it:

1. `helm install` the chart: the operator Deployment (two pods) becomes Available.
2. `kubectl apply` a ShardqCluster of 3 servers, secured as production runs it (TLS with a
   kubernetes.io/tls Secret as cert-manager writes one; every client shows a ServiceAccount
   token and needs a right to the queue), and on it Queues: `orders` (4 shards, replicas 3,
   dead letters to `orders-dlq`), `fifo` (2 shards), `payments` with its DLQ;
   `kubectl get shardqclusters,queues,shards` shows them Ready, every shard led; `helm test`
   passes (over TLS, with a token); a plaintext call and a call without a token are refused.
3. A producer Job and a consumer Job (pods running the fault suite's workload with the
   image's shardq client, every call recorded; their ServiceAccount may send, receive and
   read counts, and a projected volume gives them its token and the CA) run through:
   a leader pod deleted; a leader's server SIGKILLed in its container; a leader paused with
   SIGSTOP past its lease, then SIGCONT; the leading operator's pod killed (SIGKILL) together
   with a leader server, so the standby operator must finish that failover; a new pod
   template rolled out (every server replaced one at a time, each handing its leadership
   off); the servers scaled 3 -> 5 -> 3; `helm upgrade` to a new operator image (the server pods must not
   restart); and on `payments` a poison message dead-lettered, then redriven with the CLI and
   processed. The history checker must find nothing: no acknowledged message lost, nothing
   deleted delivered again, one holder per message, FIFO order kept.
4. Queue and cluster deletion and `helm uninstall` leave only the CRDs and the servers'
   volumes (kept by policy).

The real Prometheus half of the scenario (scraping, dashboard queries, the leaderless-shard
alert) is e2e/test_prometheus_*.py: it needs its own fault, all replicas of a shard down.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e import queue_rights
from e2e.binaries import Binaries
from e2e.cluster_tls import client_service_name, make_cluster_tls_secret
from e2e.helm import CHART, helm
from e2e.polling import wait_for
from e2e.processes import container_process, server_pid
from e2e.realnode import RunningNode
from e2e.rollouts import pod_uids, wait_every_pod_replaced
from e2e.test_chart_installs_serves_and_uninstalls_on_the_real_node import leftovers, release_cluster_objects
from e2e.test_operator_runs_queues_on_a_shardq_cluster import GROUP, VERSION, get, queue_ready, shard_leaders
from e2e.workload_jobs import PodCredentials, WorkloadJob, merge_histories, start_jobs
from shardq import Client
from shardq.bearer_tokens import TOKEN_FILE_ENV
from shardq.coordination.leases import ISR_ANNOTATION
from shardq.errors import Unauthenticated, Unavailable
from shardq.tls import CA_FILE_ENV, SERVER_NAME_ENV
from tests.faults.checking import QueueSpec, check_history, format_violations
from tests.faults.history import History, Send, StoredMessage, dump_history
from tests.faults.workload import Workload, WorkloadConfig, read_stored

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1800)]

RELEASE = "platform"
CLUSTER = "main"
SERVERS_SELECTOR = f"app.kubernetes.io/name=shardq-server,app.kubernetes.io/instance={CLUSTER}"
OPERATOR_SELECTOR = f"app.kubernetes.io/name=shardq-operator,app.kubernetes.io/instance={RELEASE}"
STATEFULSET = f"{CLUSTER}-shardq"
CHECKED = (QueueSpec("orders", dead_letter_queue="orders-dlq"), QueueSpec("fifo", fifo=True))
DRAINED = ("orders", "fifo", "orders-dlq")
LEASE = "3s"
READY_S = 300.0
FAILOVER_S = 60.0
SETTLE_S = 300.0
PROGRESS_AFTER_FAULT = 60
PAUSED_PAST_LEASE_S = 8.0
TLS_SECRET = "main-tls"
AUDIENCE = "shardq"
# The Jobs' account (send, receive, get), and the platform team's own from this host
# (every verb: the CLI's stats, redrive and purge, the final export).
WORKLOAD_ACCOUNT = "workload"
ADMIN_ACCOUNT = "platform-admin"


def manifests(namespace: str, image: str) -> list[dict[str, Any]]:
    """What the platform team applies with kubectl: a cluster and its queues."""

    def resource(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }

    queue = {"cluster": CLUSTER, "replicas": 3}
    return [
        resource(
            "ShardqCluster",
            CLUSTER,
            {
                "servers": 3,
                "image": image,
                "imagePullPolicy": "Never",
                "leaseDuration": LEASE,
                "storage": {"size": "100Mi"},
                # Leadership stays where the faults put it: the test picks its victims by it.
                "rebalance": {"mode": "off"},
                "tls": {"secretName": TLS_SECRET},
                "clientAuthentication": {"mode": "kubernetes", "audience": AUDIENCE},
            },
        ),
        resource("Queue", "orders-dlq", {**queue, "shards": 1}),
        resource(
            "Queue",
            "orders",
            {**queue, "shards": 4, "redrivePolicy": {"deadLetterQueue": "orders-dlq", "maxReceiveCount": 5}},
        ),
        resource("Queue", "fifo", {**queue, "shards": 2, "fifo": True}),
        resource("Queue", "payments-dlq", {**queue, "shards": 1}),
        resource(
            "Queue",
            "payments",
            {**queue, "shards": 1, "redrivePolicy": {"deadLetterQueue": "payments-dlq", "maxReceiveCount": 2}},
        ),
    ]


QUEUES = ("orders-dlq", "orders", "fifo", "payments-dlq", "payments")


class Platform:
    """The installed release, its cluster and the means to fault them."""

    def __init__(
        self, real_node: RunningNode, namespace: str, binaries: Binaries, api: client.ApiClient, root: pathlib.Path
    ) -> None:
        self.node = real_node
        self.info = real_node.info
        self.namespace = namespace
        self.binaries = binaries
        self.api = api
        self.root = root
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.notes: list[str] = []
        # The Roles (and their bindings, of the same names) granting rights on queues.
        self.rights: list[str] = []
        self.started = time.monotonic()
        repository, self.tag = self.info.shardq_image.rsplit(":", 1)
        self.values = (
            f"image.repository={repository}",
            f"image.tag={self.tag}",
            "image.pullPolicy=Never",
            f"cluster.name={CLUSTER}",
            f"operator.watchNamespaces={{{namespace}}}",
            # `helm test` speaks to the cluster as its clients must.
            f"cluster.tls.secretName={TLS_SECRET}",
            "cluster.clientAuthentication.mode=kubernetes",
        )

    def note(self, text: str) -> None:
        self.notes.append(f"{time.monotonic() - self.started:7.1f}s {text}")
        print(self.notes[-1], flush=True)

    # -- tools a user runs ---------------------------------------------------------------

    def helm(self, *args: str, timeout: float = 330.0) -> subprocess.CompletedProcess[str]:
        done = helm(
            self.binaries, *args, "--kubeconfig", str(self.info.kubeconfig), "-n", self.namespace, timeout=timeout
        )
        assert done.returncode == 0, f"helm {' '.join(args[:2])} failed:\n{done.stdout}\n{done.stderr}"
        return done

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        command = self.info.kubectl_command("-n", self.namespace, *args)
        done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"kubectl {' '.join(args)} failed:\n{done.stderr}"
        return done.stdout

    def cli(self, *args: str) -> str:
        """The shardq CLI from this host, through the cluster's client Service."""
        command = [sys.executable, "-m", "shardq", *args, "--endpoint", self.endpoint]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"shardq {' '.join(args)} failed ({done.returncode}):\n{done.stderr}"
        return done.stdout

    def secure(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The cluster's TLS Secret; the Jobs' account and this host's, with their rights;
        and this process's shardq clients (the CLI's too) told the CA, the name to check
        (the client Service is reached by its IP) and the admin's token."""
        issued = make_cluster_tls_secret(
            self.api, self.namespace, cluster=CLUSTER, secret=TLS_SECRET, directory=self.root / "tls"
        )
        (self.root / "ca.crt").write_bytes(issued.ca.read_bytes())
        for account, verbs in (
            (WORKLOAD_ACCOUNT, ["send", "receive", "get"]),
            (ADMIN_ACCOUNT, queue_rights.EVERY_VERB),
        ):
            self.core.create_namespaced_service_account(
                self.namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=account))
            )
            self.rights.append(queue_rights.grant(self.api, self.namespace, account, queue=None, verbs=verbs))
        token = queue_rights.account_token(self.api, self.namespace, ADMIN_ACCOUNT, audiences=[AUDIENCE])
        (self.root / "admin.token").write_text(token)
        monkeypatch.setenv(CA_FILE_ENV, str(self.root / "ca.crt"))
        monkeypatch.setenv(SERVER_NAME_ENV, client_service_name(CLUSTER, self.namespace))
        monkeypatch.setenv(TOKEN_FILE_ENV, str(self.root / "admin.token"))

    def check_refusals(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Neither a plaintext client nor one without a token gets anything."""
        with monkeypatch.context() as without_a_token:
            without_a_token.delenv(TOKEN_FILE_ENV)
            with Client(self.endpoint, route_directly=False, tls=False) as plaintext, pytest.raises(Unavailable):
                plaintext.list_queues()
            with Client(self.endpoint, route_directly=False) as anonymous, pytest.raises(Unauthenticated):
                anonymous.attributes("orders")

    @property
    def endpoint(self) -> str:
        service = self.core.read_namespaced_service(STATEFULSET, self.namespace)
        return f"{service.spec.cluster_ip}:7600"

    # -- what the test watches -----------------------------------------------------------

    def operator_logs(self) -> str:
        """The operator pods' recent logs, of the container before a restart too."""
        parts = []
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=OPERATOR_SELECTOR).items:
            restarts = sum(s.restart_count for s in pod.status.container_statuses or [])
            for previous in (True, False) if restarts else (False,):
                try:
                    text = self.core.read_namespaced_pod_log(
                        pod.metadata.name, self.namespace, tail_lines=60, previous=previous
                    )
                except ApiException:
                    continue
                parts.append(f"--- {pod.metadata.name} ({restarts} restarts, previous={previous})\n{text}")
        return "\n".join(parts)

    def server_logs(self) -> str:
        parts = []
        for pod in self.server_pods():
            try:
                text = self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace, tail_lines=30)
            except ApiException:
                continue
            parts.append(f"--- {pod.metadata.name}\n{text}")
        return "\n".join(parts)

    def server_pods(self) -> list[Any]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=SERVERS_SELECTOR).items
        return [pod for pod in pods if pod.metadata.deletion_timestamp is None]

    def ready_servers(self) -> list[str]:
        return sorted(
            pod.metadata.name
            for pod in self.server_pods()
            if any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        )

    def condition(self, kind: str) -> str:
        cluster = get(self.api, self.namespace, "shardqclusters", CLUSTER) or {}
        conditions = cluster.get("status", {}).get("conditions", [])
        return next((c.get("status", "") for c in conditions if c.get("type") == kind), "")

    def wait_settled(self, what: str, *, servers: int = 3, timeout: float = SETTLE_S) -> None:
        """Every queue Ready and in sync, the servers all Ready, no replica moving."""

        def settled() -> bool:
            return (
                len(self.ready_servers()) == servers
                and self.condition("Ready") == "True"
                and self.condition("Progressing") == "False"
                and all(queue_ready(self.api, self.namespace, name) for name in QUEUES)
            )

        wait_for(settled, timeout=timeout, interval=1.0, what=what, explain=self.operator_logs)

    def wait_failed_over(self, queue: str, index: int, victim: str, epoch: int) -> str:
        def failed_over() -> str | None:
            leader, now = shard_leaders(self.api, self.namespace, queue).get(index, ("", 0))
            return leader if now > epoch and leader and leader != victim else None

        try:
            return wait_for(failed_over, timeout=FAILOVER_S, interval=0.2, what=f"{queue}.{index} failing over")
        except TimeoutError as error:
            raise AssertionError(f"{error} from {victim}\n{self.explain(victim)}\n{self.operator_logs()}") from None

    def explain(self, server: str) -> str:
        """The shard Leases (holder, epoch, in-sync replicas), every server pod's state and
        the victim's in full, for a failover that did not happen."""
        leases = client.CoordinationV1Api(self.api).list_namespaced_lease(self.namespace).items
        lines = [
            f"lease {lease.metadata.name}: holder {lease.spec.holder_identity} transitions "
            f"{lease.spec.lease_transitions} renewed {lease.spec.renew_time} for {lease.spec.lease_duration_seconds}s "
            f"isr {(lease.metadata.annotations or {}).get(ISR_ANNOTATION, '-')}"
            for lease in leases
        ]
        for pod in self.server_pods():
            ready = [(c.status, c.last_transition_time) for c in pod.status.conditions or [] if c.type == "Ready"]
            containers = [(s.name, s.restart_count, s.state) for s in pod.status.container_statuses or []]
            lines.append(f"pod {pod.metadata.name}: Ready {ready} containers {containers}")
        try:
            pod = self.core.read_namespaced_pod(server, self.namespace)
            lines.append(f"pod {server} conditions: {pod.status.conditions}")
            lines.append(f"pod {server} containers: {pod.status.container_statuses}")
        except ApiException as error:
            lines.append(f"pod {server}: {error.reason}")
        lines.append(f"now {time.strftime('%H:%M:%S', time.gmtime())} UTC")
        return "\n".join(lines)

    def scale(self, servers: int) -> None:
        patch = json.dumps({"spec": {"servers": servers}})
        self.kubectl("patch", "shardqcluster", CLUSTER, "--type=merge", "-p", patch)

    def leading_operator(self) -> str:
        lease = client.CoordinationV1Api(self.api).read_namespaced_lease("shardq-operator", self.namespace)
        holder: str = lease.spec.holder_identity
        return holder

    def server_restarts(self) -> dict[str, tuple[str, int]]:
        """Each server pod's uid and container restart count: what a restart would change."""
        return {
            pod.metadata.name: (pod.metadata.uid, sum(s.restart_count for s in pod.status.container_statuses or []))
            for pod in self.server_pods()
        }


@pytest.fixture
def platform(
    real_node: RunningNode, node_namespace: str, binaries: Binaries, tmp_path: pathlib.Path
) -> Iterator[Platform]:
    with real_node.info.api_client() as api:
        installed = Platform(real_node, node_namespace, binaries, api, tmp_path)
        try:
            yield installed
        finally:
            # Best effort on a failure: no operator of this release outlives the test.
            helm(
                binaries, "uninstall", RELEASE, "--kubeconfig", str(real_node.info.kubeconfig),
                "-n", node_namespace, "--wait", "--timeout", "2m", timeout=150,
            )  # fmt: skip
            (tmp_path / "notes.txt").write_text("\n".join(installed.notes) + "\n")


# -- the faults, each followed by progress of both Jobs ---------------------------------------


def wait_for_progress(platform: Platform, jobs: tuple[WorkloadJob, ...], *, after: str) -> None:
    before = [job.acknowledged() for job in jobs]

    def progressed() -> bool:
        return all(job.acknowledged() >= start + PROGRESS_AFTER_FAULT for job, start in zip(jobs, before, strict=True))

    wait_for(
        progressed,
        timeout=FAILOVER_S,
        interval=0.5,
        what=f"{PROGRESS_AFTER_FAULT} acknowledged operations of each Job after {after}",
        explain=platform.operator_logs,
    )
    platform.note(f"the Jobs progressed after {after}: {[job.acknowledged() for job in jobs]} acknowledged")


def delete_a_leader_pod(platform: Platform) -> None:
    victim, epoch = shard_leaders(platform.api, platform.namespace, "orders")[0]
    platform.kubectl("delete", "pod", victim, "--wait=false")
    leader = platform.wait_failed_over("orders", 0, victim, epoch)
    platform.note(f"orders.0: pod {victim} deleted, {leader} leads")


def kill_a_leader_container(platform: Platform) -> None:
    victim, epoch = shard_leaders(platform.api, platform.namespace, "orders")[1]
    os.kill(server_pid(platform.namespace, victim), signal.SIGKILL)
    leader = platform.wait_failed_over("orders", 1, victim, epoch)
    platform.note(f"orders.1: server of {victim} SIGKILLed in its container, {leader} leads")


def pause_a_leader_past_its_lease(platform: Platform) -> None:
    """SIGSTOP: the process neither serves nor renews; others must take over and fence it,
    and once continued it must not act as leader on its stale epoch."""
    victim, epoch = shard_leaders(platform.api, platform.namespace, "orders")[2]
    pid = server_pid(platform.namespace, victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        paused_at = time.monotonic()
        leader = platform.wait_failed_over("orders", 2, victim, epoch)
        time.sleep(max(0.0, PAUSED_PAST_LEASE_S - (time.monotonic() - paused_at)))
    finally:
        os.kill(pid, signal.SIGCONT)
    platform.note(f"orders.2: {victim} paused {time.monotonic() - paused_at:.1f}s (lease {LEASE}), {leader} leads")


def kill_the_leading_operator_with_a_leader(platform: Platform) -> None:
    """The acting operator's pod killed (its process SIGKILLed, so it releases nothing, and
    the pod removed) together with a shard leader's server: the standby operator must take
    the operator Lease over and finish that failover."""
    operator = platform.leading_operator()
    victim, epoch = shard_leaders(platform.api, platform.namespace, "fifo")[0]
    os.kill(container_process(operator, "operator"), signal.SIGKILL)
    platform.core.delete_namespaced_pod(operator, platform.namespace, grace_period_seconds=0)
    os.kill(server_pid(platform.namespace, victim), signal.SIGKILL)
    leader = platform.wait_failed_over("fifo", 0, victim, epoch)
    now_leading = wait_for(
        lambda: platform.leading_operator() != operator and platform.leading_operator(),
        timeout=FAILOVER_S,
        what="another operator pod to hold the operator Lease",
    )
    platform.note(f"operator pod {operator} killed with fifo.0's leader {victim}: {now_leading} acts, {leader} leads")


def roll_the_pods(platform: Platform) -> None:
    """A change that needs new pods (resources): the StatefulSet replaces them one at a
    time, and each stopping server hands its leadership off first."""
    patch = json.dumps({"spec": {"resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}})
    before = pod_uids(platform.server_pods())
    platform.kubectl("patch", "shardqcluster", CLUSTER, "--type=merge", "-p", patch)
    wait_every_pod_replaced(
        platform.apps,
        platform.namespace,
        STATEFULSET,
        platform.server_pods,
        before,
        timeout=SETTLE_S,
        explain=platform.operator_logs,
    )
    platform.note(f"a new pod template rolled out: all {len(before)} server pods replaced one at a time")


def scale_out_and_back_in(platform: Platform) -> None:
    platform.scale(5)
    platform.wait_settled("replicas spread onto 5 servers", servers=5)
    placed = {
        server
        for shard in platform.custom.list_namespaced_custom_object(GROUP, VERSION, platform.namespace, "shards")[
            "items"
        ]
        for server in shard["spec"]["replicas"]
    }
    assert {f"{STATEFULSET}-3", f"{STATEFULSET}-4"} <= placed, f"no replica moved to the new pods: {placed}"
    platform.note("scaled out to 5 servers: replicas on the new pods")
    platform.scale(3)
    wait_for(
        lambda: platform.apps.read_namespaced_stateful_set(STATEFULSET, platform.namespace).spec.replicas == 3,
        timeout=SETTLE_S,
        interval=1.0,
        what="the StatefulSet shrunk once replicas moved off",
        explain=platform.operator_logs,
    )
    platform.wait_settled("back to 3 servers", servers=3)
    leaders = {
        leader for queue in QUEUES for leader, _ in shard_leaders(platform.api, platform.namespace, queue).values()
    }
    assert leaders <= {f"{STATEFULSET}-{n}" for n in range(3)}, leaders
    platform.note("scaled back in to 3 servers")


def upgrade_the_operator(platform: Platform) -> None:
    """`helm upgrade` to a new operator image: the operator pods roll, the servers do not."""
    layout = platform.node.own_node("tagging a new operator image in its containerd")
    new_tag = f"{platform.tag}-upgrade"
    repository = platform.info.shardq_image.rsplit(":", 1)[0]
    subprocess.run(
        ["ctr", "--address", str(layout.containerd_socket), "--namespace", "k8s.io", "images", "tag", "--force",
         platform.info.shardq_image, f"{repository}:{new_tag}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    servers_before = platform.server_restarts()
    generation = platform.apps.read_namespaced_stateful_set(STATEFULSET, platform.namespace).metadata.generation
    platform.helm("upgrade", RELEASE, str(CHART), "--reuse-values", "--set", f"image.tag={new_tag}", "--wait",
                  "--timeout", "5m")  # fmt: skip
    operators = platform.core.list_namespaced_pod(platform.namespace, label_selector=OPERATOR_SELECTOR).items
    running = {pod.spec.containers[0].image for pod in operators if pod.metadata.deletion_timestamp is None}
    assert running == {f"{repository}:{new_tag}"}, running
    wait_for(
        lambda: platform.leading_operator() in {pod.metadata.name for pod in operators},
        timeout=FAILOVER_S,
        what="an upgraded operator pod to hold the operator Lease",
    )
    # Give the new operator time to reconcile everything once before judging the servers.
    time.sleep(10)
    assert platform.server_restarts() == servers_before, "an operator upgrade restarted server pods"
    after = platform.apps.read_namespaced_stateful_set(STATEFULSET, platform.namespace).metadata.generation
    assert after == generation, f"the operator upgrade changed the StatefulSet ({generation} -> {after})"
    platform.note(f"helm upgrade to {new_tag}: operator pods rolled, servers untouched")


def dead_letter_a_poison_message_and_redrive_it(platform: Platform) -> None:
    """A message that fails processing twice lands in `payments-dlq`; once the bug is
    fixed the operator of the service redrives it and it is processed."""
    sent = json.loads(platform.cli("send", "--queue", "payments", "--body", "poison-1", "--json"))
    for _ in range(2):
        received = platform.cli("receive", "--queue", "payments", "--visibility", "1s", "--wait", "5s", "--json")
        assert json.loads(received.splitlines()[0])["id"] == sent["id"], received
        time.sleep(1.5)  # processing failed: the message becomes visible again

    def dead_lettered() -> bool:
        # A receive past maxReceiveCount moves the message instead of delivering it.
        assert platform.cli("receive", "--queue", "payments", "--wait", "1s", "--json").strip() == ""
        stats = json.loads(platform.cli("stats", "--queue", "payments-dlq", "--json"))
        return bool(stats["visible"] == 1)

    try:
        wait_for(dead_lettered, timeout=30, interval=0.5, what="the poison message in payments-dlq")
    except TimeoutError as error:
        stats = platform.cli("stats", "--queue", "payments", "--json")
        raise AssertionError(f"{error}\npayments: {stats}\n{platform.server_logs()}") from None
    moved = platform.cli("redrive", "--from", "payments-dlq", "--to", "payments")
    assert moved.strip() == "moved 1", moved
    received = platform.cli("receive", "--queue", "payments", "--wait", "5s", "--json")
    assert received.strip(), (
        "the redriven message was not delivered: "
        + " ".join(platform.cli("stats", "--queue", q, "--json") for q in ("payments", "payments-dlq"))
        + platform.server_logs()
    )
    message = json.loads(received.splitlines()[0])
    assert message["body"] == "poison-1", message
    platform.cli("delete", "--queue", "payments", "--receipt", message["receipt"])
    for queue in ("payments", "payments-dlq"):
        stats = json.loads(platform.cli("stats", "--queue", queue, "--json"))
        assert stats["visible"] + stats["in_flight"] + stats["delayed"] == 0, (queue, stats)
    platform.note("poison message dead-lettered after 2 receives, redriven and processed")


FAULTS = (
    delete_a_leader_pod,
    kill_a_leader_container,
    pause_a_leader_past_its_lease,
    kill_the_leading_operator_with_a_leader,
    roll_the_pods,
    scale_out_and_back_in,
    upgrade_the_operator,
    dead_letter_a_poison_message_and_redrive_it,
)


def test_the_whole_system_keeps_every_message_through_faults_upgrade_and_redrive(
    platform: Platform, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = platform.namespace
    platform.secure(monkeypatch)
    platform.helm("install", RELEASE, str(CHART), *[a for v in platform.values for a in ("--set", v)], "--wait",
                  "--timeout", "5m")  # fmt: skip
    platform.note("helm install: the operator Deployment is Available")

    applied = yaml.safe_dump_all(manifests(namespace, platform.info.shardq_image))
    platform.kubectl("apply", "-f", "-", stdin=applied)
    platform.wait_settled("the cluster and its queues Ready", timeout=READY_S)
    listing = platform.kubectl("get", "shardqclusters,queues,shards")
    print(listing)
    for queue in QUEUES:
        leaders = shard_leaders(platform.api, namespace, queue)
        assert leaders, queue
        assert all(leader for leader, _ in leaders.values()), (queue, leaders)
        assert f"queue.shardq.io/{queue} " in listing, listing
    platform.note("kubectl apply: the cluster, 5 queues and their shards Ready, every shard led")
    tested = platform.helm("test", RELEASE, "--logs", "--timeout", "4m")
    assert "PASS: sent, received and deleted message" in tested.stdout, tested.stdout
    platform.note("helm test passed")
    platform.check_refusals(monkeypatch)
    platform.note("a plaintext call and a call without a token refused")

    service = f"{STATEFULSET}.{namespace}.svc.cluster.local:7600"
    producers, consumers = start_jobs(
        platform.api,
        namespace,
        image=platform.info.shardq_image,
        endpoint=service,
        seed=14,
        credentials=PodCredentials(service_account=WORKLOAD_ACCOUNT, tls_secret=TLS_SECRET, audience=AUDIENCE),
    )
    jobs = (producers, consumers)
    for job in jobs:
        job.wait_running()
    platform.note("producer and consumer Jobs running")
    for fault in FAULTS:
        fault(platform)
        wait_for_progress(platform, jobs, after=fault.__name__)
        platform.wait_settled(f"settled after {fault.__name__}")

    producers.stop(platform.info)
    produced = producers.history()
    consumers.stop(platform.info)
    consumed = consumers.history()
    platform.note(f"Jobs stopped: {len(produced)} + {len(consumed)} operations recorded in the pods")

    drain_history = History()
    drained = Workload(
        endpoints=lambda: [platform.endpoint],
        history=drain_history,
        config=WorkloadConfig(seed=14, route_directly=False),
    )
    drained.drain(DRAINED, timeout=180)
    endpoints = sorted(f"{pod.status.pod_ip}:7600" for pod in platform.server_pods() if pod.status.pod_ip)
    final: list[StoredMessage] = read_stored(endpoints, DRAINED)
    operations = merge_histories(produced, consumed, drain_history.operations())
    path = tmp_path / "history.jsonl"
    dump_history(operations, path, final=final)
    violations = check_history(operations, final=final, queues=CHECKED)
    assert not violations, f"{len(violations)} violations; history in {path}\n{format_violations(violations)}"
    acknowledged = sum(1 for o in operations if o.ok and isinstance(o, Send))
    assert acknowledged > 500, f"only {acknowledged} sends were acknowledged"
    platform.note(f"history checked: {len(operations)} operations, {acknowledged} acknowledged sends, no violation")

    # Everything the operator did is visible as Events.
    reasons = {event.reason for event in platform.core.list_namespaced_event(namespace).items}
    assert {"Failover", "ReplicaMoveStarted", "ReplicaMoveFinished"} <= reasons, reasons

    # What the user made goes with kubectl delete; the chart's part with helm uninstall.
    platform.kubectl("delete", "jobs,configmaps", "-l", "app.kubernetes.io/name=workload", "--wait=true")
    platform.kubectl("delete", "configmap", "workload-code", "--ignore-not-found")
    platform.kubectl("delete", "queues", "--all", "--wait=true", "--timeout=180s")
    platform.kubectl("delete", "shardqcluster", CLUSTER, "--wait=true", "--timeout=180s")
    platform.kubectl("delete", "secret", TLS_SECRET)
    platform.kubectl("delete", "serviceaccounts", WORKLOAD_ACCOUNT, ADMIN_ACCOUNT)
    platform.kubectl("delete", *[f"{kind}/{name}" for name in platform.rights for kind in ("role", "rolebinding")])
    platform.helm("uninstall", RELEASE, "--wait", "--timeout", "4m")

    def only_volumes_left() -> dict[str, list[str]] | None:
        left = leftovers(platform.api, namespace)
        claims = left.pop("persistentvolumeclaims", [])
        settled = not left and claims and all(name.startswith(f"data-{STATEFULSET}-") for name in claims)
        return {"persistentvolumeclaims": claims} if settled else None

    kept = wait_for(only_volumes_left, timeout=180, what=f"only the servers' PVCs left in {namespace}")
    assert release_cluster_objects(platform.api, RELEASE) == []
    platform.note(f"uninstalled: left {kept} and the CRDs")
