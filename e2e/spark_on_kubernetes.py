"""The analytics report on Spark-on-Kubernetes, run the way users run it, on the real node.

    python -m e2e.spark_on_kubernetes [--namespace spark-report] [--out DIR]

On the running real node (`e2e/cluster up`), in a namespace of its own:
1. builds (or reuses) the Spark image of e2e.spark_image and imports it into containerd;
2. runs the operator on the host, applies a ShardqCluster (2 servers) that serves TLS
   (a kubernetes.io/tls Secret, as cert-manager writes one) and asks every client for a
   ServiceAccount token and a right to the queue, with a Queue `orders` (4 shards,
   replicas 2, dead letters to `orders-dlq`), and sends a workload whose outcome is
   known: PROCESSED messages received and deleted, POISON messages received twice and
   dead-lettered, PENDING never touched (as an account that may send, receive and read
   counts);
3. creates the driver's ServiceAccount and Role (executor pods, their Service, ConfigMaps),
   allowed `export` on `orders` and nothing else of shardq's, and a submitter's (a token
   that may make the driver's pod, Service and ConfigMap);
4. runs this machine's `spark-submit --master k8s://<API server> --deploy-mode cluster`
   with the image and `local:///opt/shardq/report_job.py`; a pod template gives the
   driver and each executor a projected volume with a token for audience shardq and the
   CA (copied from the Secret into a ConfigMap, as a job in another namespace than the
   cluster's must have it), and SHARDQ_TOKEN_FILE and SHARDQ_CA_FILE point at them;
   the job reads the shards over TLS by the cluster's in-cluster DNS name (its client
   Service; each shard's leader by its pod's DNS name) and writes Parquet and the report
   to a hostPath volume: this is a single node, so driver and executors share one
   directory, and the host reads the result without another pod (a ReadWriteMany claim
   would take its place on a real cluster);
5. checks the report against the workload (summary.json, and the Parquet lifecycles
   table read with pyarrow) and records the times (image build and import apart from
   submit-to-done) and the peak memory of the driver and executor pods (their cgroups,
   sampled while they run) in bench/results/spark-on-kubernetes.json;
6. deletes what it made (queues, cluster, namespace) and stops the operator.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from shardq_operator import naming

from e2e import queue_rights
from e2e.cluster_tls import (
    CREDENTIALS_MOUNT,
    client_service_name,
    credentials_environment,
    credentials_volume,
    make_cluster_tls_secret,
)
from e2e.crds import install_crds
from e2e.images import REPO_ROOT
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from e2e.realnode import Layout, NodeInfo, recycle_released_volumes, state_dir, status
from e2e.spark_image import APPLICATION, SPARK_UID, build_spark_image, ensure_imported
from shardq import Client, Message, ShardqError
from shardq.errors import Reason
from shardq.tls import ClientTls

GROUP, VERSION = "shardq.io", "v1alpha1"
RESULTS = REPO_ROOT / "bench" / "results" / "spark-on-kubernetes.json"
DEFAULT_NAMESPACE = "spark-report"
CLUSTER = "main"
QUEUE = "orders"
DEAD_LETTER_QUEUE = "orders-dlq"
SHARDS = 4
SERVERS = 2
REPLICAS = 2
MAX_RECEIVE_COUNT = 2
# The workload: its outcome is what the report must show.
PROCESSED = 150
POISON = 20
PENDING = 30
SERVICE_ACCOUNT = "shardq-spark"
REPORT_VOLUME = "report"
REPORT_MOUNT = "/report"
# The cluster's serving certificate, and who sends the workload from the host.
TLS_SECRET = "main-tls"
WORKLOAD_ACCOUNT = "shardq-workload"
TOKEN_AUDIENCE = "shardq"
# What the Spark pods show shardq (e2e.cluster_tls.credentials_volume): a token, and the
# CA from a ConfigMap, as a job in another namespace than the cluster's must have it.
CREDENTIALS_VOLUME = "shardq-credentials"
CA_CONFIG_MAP = "shardq-ca"
READY_S = 240.0
SUBMIT_TIMEOUT_S = 900.0
PROGRESS_EVERY_S = 10.0
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory/kubepods")


def log(message: str) -> None:
    print(f"[spark-on-k8s {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Expected:
    """What the report must say about the workload, exactly."""

    sent: int = PROCESSED + POISON + PENDING
    deleted: int = PROCESSED
    dead_lettered: int = POISON
    pending: int = PENDING
    redelivered: int = POISON
    # SENT, RECEIVED, DELETED per processed message; SENT, 2 x RECEIVED, DEAD_LETTERED,
    # DEAD_LETTER_DELIVERED per poison message; SENT per pending one.
    events: int = 3 * PROCESSED + (3 + MAX_RECEIVE_COUNT) * POISON + PENDING


@dataclass(frozen=True)
class Submission:
    """What spark-submit is asked to run; examples/spark/report-sparkapplication.yaml says
    the same to the spark-operator (a test compares them)."""

    namespace: str
    image: str
    endpoint: str
    report_host_path: Path
    queue: str = QUEUE
    name: str = "shardq-report"
    executors: int = 2
    driver_memory: str = "512m"
    # Beyond the JVM's heap the driver pod holds the job's Python (pandas, pyarrow,
    # matplotlib for the plots) and the data source's planner: Spark's default overhead
    # (384 MiB) got it OOM-killed at its 896 MiB limit.
    driver_memory_overhead: str = "1g"
    executor_memory: str = "512m"
    # The node's two cores are shared: ask for little, use what is free.
    cpu_request: str = "100m"
    service_account: str = SERVICE_ACCOUNT
    ca_config_map: str = CA_CONFIG_MAP

    @property
    def driver_pod(self) -> str:
        return f"{self.name}-driver"

    def job_arguments(self) -> list[str]:
        return ["--endpoint", self.endpoint, "--queue", self.queue, "--out", f"{REPORT_MOUNT}/{self.queue}"]

    def pod_template(self) -> dict[str, Any]:
        """The driver's and the executors' pod template: spark-submit has no setting for a
        projected ServiceAccount token, so the volume comes in a template (Spark keeps the
        template's volumes and adds its own; its container is the first one)."""
        volume = credentials_volume(CREDENTIALS_VOLUME, audience=TOKEN_AUDIENCE, ca_config_map=self.ca_config_map)
        mount = {"name": CREDENTIALS_VOLUME, "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": {"volumes": [volume], "containers": [{"name": "spark", "volumeMounts": [mount]}]},
        }

    def spark_conf(self) -> dict[str, str]:
        conf = {
            "spark.kubernetes.namespace": self.namespace,
            "spark.kubernetes.container.image": self.image,
            # Images are imported into containerd: there is no registry to pull from.
            "spark.kubernetes.container.image.pullPolicy": "Never",
            "spark.kubernetes.authenticate.driver.serviceAccountName": self.service_account,
            "spark.kubernetes.driver.pod.name": self.driver_pod,
            "spark.executor.instances": str(self.executors),
            "spark.driver.cores": "1",
            "spark.executor.cores": "1",
            "spark.kubernetes.driver.request.cores": self.cpu_request,
            "spark.kubernetes.executor.request.cores": self.cpu_request,
            "spark.driver.memory": self.driver_memory,
            "spark.driver.memoryOverhead": self.driver_memory_overhead,
            "spark.executor.memory": self.executor_memory,
            "spark.sql.session.timeZone": "UTC",
            # One task per shard; more shuffle partitions only add scheduling on two cores.
            "spark.sql.shuffle.partitions": str(SHARDS),
            "spark.ui.enabled": "false",
            "spark.kubernetes.report.interval": "10s",
        }
        for role in ("driver", "executor"):
            prefix = f"spark.kubernetes.{role}.volumes.hostPath.{REPORT_VOLUME}"
            conf[f"{prefix}.mount.path"] = REPORT_MOUNT
            conf[f"{prefix}.options.path"] = str(self.report_host_path)
        for name, value in credentials_environment().items():
            conf[f"spark.kubernetes.driverEnv.{name}"] = value
            conf[f"spark.executorEnv.{name}"] = value
        return conf

    def command(self, spark_submit: Path, api_server: str, pod_template: Path) -> list[str]:
        """spark-submit's words, with the pod template written to `pod_template` (it reads
        the driver's itself and hands the executors' to the driver in a ConfigMap)."""
        pod_template.write_text(yaml.safe_dump(self.pod_template()))
        templates = {f"spark.kubernetes.{role}.podTemplateFile": str(pod_template) for role in ("driver", "executor")}
        settings = self.spark_conf() | templates
        conf = [word for key, value in settings.items() for word in ("--conf", f"{key}={value}")]
        return [
            str(spark_submit),
            "--master",
            f"k8s://{api_server}",
            "--deploy-mode",
            "cluster",
            "--name",
            self.name,
            *conf,
            APPLICATION,
            *self.job_arguments(),
        ]


def in_cluster_endpoint(namespace: str) -> str:
    """The ShardqCluster's client Service by its in-cluster DNS name."""
    return f"{naming.client_service(CLUSTER)}.{namespace}.svc.cluster.local:{naming.GRPC_PORT}"


def spark_submit_path() -> Path:
    """The spark-submit of the pyspark package installed here (the `spark` extra)."""
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-submit"


# -- shardq on the node ----------------------------------------------------------


def _apply(api: client.ApiClient, namespace: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def _get(api: client.ApiClient, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return found


def _queue_ready(api: client.ApiClient, namespace: str, name: str) -> bool:
    queue = _get(api, namespace, "queues", name) or {}
    conditions = {c["type"]: c["status"] for c in queue.get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True" and conditions.get("UnderReplicated") == "False"


def create_shardq(api: client.ApiClient, namespace: str, image: str) -> None:
    """The ShardqCluster, serving TLS with TLS_SECRET and asking clients for tokens, and
    its two queues, Ready with every replica in sync."""
    _apply(
        api,
        namespace,
        "shardqclusters",
        "ShardqCluster",
        CLUSTER,
        {
            "servers": SERVERS,
            "image": image,
            "imagePullPolicy": "Never",
            "storage": {"size": "100Mi"},
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
            "tls": {"secretName": TLS_SECRET},
            "clientAuthentication": {"mode": "kubernetes", "audience": TOKEN_AUDIENCE},
        },
    )
    _apply(
        api, namespace, "queues", "Queue", DEAD_LETTER_QUEUE, {"cluster": CLUSTER, "shards": 1, "replicas": REPLICAS}
    )
    _apply(
        api,
        namespace,
        "queues",
        "Queue",
        QUEUE,
        {
            "cluster": CLUSTER,
            "shards": SHARDS,
            "replicas": REPLICAS,
            "visibilityTimeout": "300ms",
            "redrivePolicy": {"deadLetterQueue": DEAD_LETTER_QUEUE, "maxReceiveCount": MAX_RECEIVE_COUNT},
        },
    )
    for name in (QUEUE, DEAD_LETTER_QUEUE):
        wait_for(
            lambda name=name: _queue_ready(api, namespace, name),
            timeout=READY_S,
            what=f"queue {name} Ready",
            interval=1,
        )


def delete_shardq(api: client.ApiClient, namespace: str) -> None:
    """Queues first, then the cluster (it refuses to go while it hosts queues), while the
    operator runs to release their finalizers."""
    custom = client.CustomObjectsApi(api)
    for plural, name in (("queues", QUEUE), ("queues", DEAD_LETTER_QUEUE), ("shardqclusters", CLUSTER)):
        with contextlib.suppress(ApiException):
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    wait_for(
        lambda: _get(api, namespace, "shardqclusters", CLUSTER) is None, timeout=120, what="the ShardqCluster deleted"
    )


# A server that forwards a send to a peer just made Ready may find the peer's DNS name not
# yet published: those entries answer UNAVAILABLE, nothing stored, and a producer sends
# them again (their dedup ids keep each message single). Any other failure is the test's.
SEND_AGAIN_FOR_S = 30.0


def _send(client_: Client, label: str, count: int) -> set[str]:
    ids: set[str] = set()
    for first in range(0, count, 10):
        batch = [
            Message(f"{label}-{n}".encode(), dedup_id=f"{label}-{n}") for n in range(first, min(first + 10, count))
        ]
        gives_up_at = time.monotonic() + SEND_AGAIN_FOR_S
        while batch:
            results = client_.send_messages(QUEUE, batch)
            ids |= {result.message_id for result in results if result.ok}
            failed = [(message, result) for message, result in zip(batch, results, strict=True) if not result.ok]
            if failed and (
                any(result.error_reason != Reason.UNAVAILABLE for _, result in failed) or time.monotonic() > gives_up_at
            ):
                raise RuntimeError(f"sending {label} messages failed: {failed[0][1]}")
            if failed:
                print(f"[spark-on-k8s] {len(failed)} {label} sends UNAVAILABLE, sent again: {failed[0][1]}")
                time.sleep(0.5)
            batch = [message for message, _ in failed]
    return ids


def run_workload(endpoint: str, *, tls: ClientTls, token: str, timeout: float = 120.0) -> None:
    """PROCESSED messages received once and deleted, POISON received MAX_RECEIVE_COUNT
    times and dead-lettered (from every shard: some led beside the dead-letter queue,
    some not), PENDING sent last and never received."""
    with Client(endpoint, route_directly=False, tls=tls, token=token) as producer:
        processed = _send(producer, "processed", PROCESSED)
        received: dict[str, str] = {}

        def all_received() -> bool:
            # A long visibility timeout: none of these may be delivered twice.
            for message in producer.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000):
                received[message.message_id] = message.receipt
            return len(received) >= PROCESSED

        wait_for(
            all_received, timeout=timeout, what=f"{PROCESSED} processed messages received", retry_on=(ShardqError,)
        )
        if set(received) != processed:
            raise RuntimeError(f"received {len(received)} messages, not the {PROCESSED} sent")
        receipts = list(received.values())
        for first in range(0, len(receipts), 10):
            if not all(result.ok for result in producer.delete_messages(QUEUE, receipts[first : first + 10])):
                raise RuntimeError("a delete of a processed message failed")

        poison = _send(producer, "poison", POISON)
        receives = dict.fromkeys(poison, 0)

        def all_dead_lettered() -> bool:
            # Each poll also moves the messages past maxReceiveCount to the dead-letter queue.
            for message in producer.receive_messages(QUEUE, max_messages=10, wait_time_ms=100):
                receives[message.message_id] += 1
            return producer.attributes(DEAD_LETTER_QUEUE).visible >= POISON

        wait_for(all_dead_lettered, timeout=timeout, what=f"{POISON} poison messages dead-lettered")
        if receives != dict.fromkeys(poison, MAX_RECEIVE_COUNT):
            raise RuntimeError(f"poison messages were not each received {MAX_RECEIVE_COUNT} times: {receives}")
        _send(producer, "pending", PENDING)


def refusals(endpoint: str, *, tls: ClientTls, spark_token: str) -> dict[str, str]:
    """How the cluster answers a call without a token, and the Spark account's token
    asking to receive (it may only export): the report runs against a cluster that
    refuses both, or the run proves nothing about its credentials."""

    def reason_of(call: Callable[[Client], object], token: str | None) -> str:
        with Client(endpoint, route_directly=False, tls=tls, token=token) as caller:
            try:
                call(caller)
            except ShardqError as error:
                return error.reason.value
        return "answered"

    return {
        "without_a_token": reason_of(lambda caller: caller.attributes(QUEUE), None),
        "spark_account_receiving": reason_of(lambda caller: caller.receive_messages(QUEUE), spark_token),
    }


# -- Spark's account and the run ----------------------------------------------------


def create_driver_account(api: client.ApiClient, namespace: str) -> None:
    """The driver's ServiceAccount and the Role it needs to run executors: their pods, the
    headless Service that names the driver, and the ConfigMaps Spark mounts."""
    client.CoreV1Api(api).create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=SERVICE_ACCOUNT))
    )
    rbac = client.RbacAuthorizationV1Api(api)
    verbs = ["create", "get", "list", "watch", "delete", "deletecollection", "patch"]
    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="shardq-spark-driver"),
            rules=[
                client.V1PolicyRule(api_groups=[""], resources=["pods", "services", "configmaps"], verbs=verbs),
                client.V1PolicyRule(api_groups=[""], resources=["persistentvolumeclaims"], verbs=verbs),
            ],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="shardq-spark-driver"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="shardq-spark-driver"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=SERVICE_ACCOUNT, namespace=namespace)],
        ),
    )
    # The report reads the queue's stored messages and journal, and needs nothing else:
    # not the right to receive (which would claim), nor to read the dead-letter queue.
    queue_rights.grant(api, namespace, SERVICE_ACCOUNT, queue=QUEUE, verbs=["export"])


SUBMITTER = "spark-submitter"


def write_submitter_kubeconfig(api: client.ApiClient, info: NodeInfo, namespace: str, path: Path) -> Path:
    """A kubeconfig for spark-submit: a ServiceAccount token allowed to make the driver's
    pod, Service and ConfigMap in `namespace` only (what a user submitting jobs gets).

    Not the admin's client certificate: fabric8 (Spark's Kubernetes client) reads a PKCS#8
    key as RSA, and the node's keys are EC ("Invalid DER: object is not integer")."""
    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=SUBMITTER))
    )
    rbac = client.RbacAuthorizationV1Api(api)
    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name=SUBMITTER),
            rules=[
                client.V1PolicyRule(
                    api_groups=[""],
                    resources=["pods", "services", "configmaps"],
                    verbs=["create", "get", "list", "watch", "delete", "patch", "update"],
                ),
                client.V1PolicyRule(api_groups=[""], resources=["pods/log"], verbs=["get"]),
                # Spark 4 puts the application's pods behind a NetworkPolicy of their own.
                client.V1PolicyRule(
                    api_groups=["networking.k8s.io"],
                    resources=["networkpolicies"],
                    verbs=["create", "get", "list", "watch", "delete", "patch", "update"],
                ),
            ],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=SUBMITTER),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=SUBMITTER),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=SUBMITTER, namespace=namespace)],
        ),
    )
    token = core.create_namespaced_service_account_token(
        SUBMITTER,
        namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)),
    ).status.token
    admin = yaml.safe_load(info.kubeconfig.read_text())
    (cluster,) = admin["clusters"]
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": SUBMITTER, "user": {"token": token}}],
        "contexts": [
            {"name": SUBMITTER, "context": {"cluster": cluster["name"], "user": SUBMITTER, "namespace": namespace}}
        ],
        "current-context": SUBMITTER,
    }
    path.write_text(yaml.safe_dump(kubeconfig))
    path.chmod(0o600)
    return path


@dataclass
class PodMemory:
    name: str
    role: str
    # The cgroup's high-water mark: anonymous memory plus the page cache it was charged
    # (jars read, Parquet written), which the kernel reclaims near the limit.
    peak_bytes: int = 0
    # The largest anonymous (RSS) memory seen in a sample: what the JVMs and Python use.
    peak_rss_bytes: int = 0
    limit_bytes: int = 0


@dataclass
class MemorySampler:
    """Peak memory of the Spark pods, from their cgroups (v1: memory.max_usage_in_bytes,
    the pod's high-water mark), read on the host twice a second while they exist: the
    cgroup goes with the pod (executors are deleted when the driver finishes)."""

    info: NodeInfo
    namespace: str
    pods: dict[str, PodMemory] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _cgroups: dict[str, Path] = field(default_factory=dict)

    def _list_pods(self, api: client.ApiClient) -> None:
        listed = client.CoreV1Api(api).list_namespaced_pod(self.namespace, label_selector="spark-role").items
        for pod in listed:
            if pod.metadata.uid not in self.pods:
                self.pods[pod.metadata.uid] = PodMemory(pod.metadata.name, pod.metadata.labels["spark-role"])

    def _sample(self) -> None:
        for uid, pod in self.pods.items():
            if uid not in self._cgroups:
                found = next(CGROUP_MEMORY.glob(f"**/pod{uid}"), None)
                if found is None:
                    continue
                self._cgroups[uid] = found
            with contextlib.suppress(OSError, StopIteration):  # the pod has just gone
                stat = (self._cgroups[uid] / "memory.stat").read_text().splitlines()
                rss = next(int(line.split()[1]) for line in stat if line.startswith("total_rss "))
                pod.peak_rss_bytes = max(pod.peak_rss_bytes, rss)
            with contextlib.suppress(OSError):  # the pod has just gone
                pod.peak_bytes = max(
                    pod.peak_bytes, int((self._cgroups[uid] / "memory.max_usage_in_bytes").read_text())
                )
                pod.limit_bytes = int((self._cgroups[uid] / "memory.limit_in_bytes").read_text())

    def _run(self) -> None:
        with self.info.api_client() as api:
            tick = 0
            while not self._stop.is_set():
                if tick % 4 == 0:
                    with contextlib.suppress(ApiException):
                        self._list_pods(api)
                self._sample()
                tick += 1
                self._stop.wait(0.5)

    @contextlib.contextmanager
    def running(self) -> Iterator[MemorySampler]:
        thread = threading.Thread(target=self._run, name="spark-memory", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=10)

    def of_role(self, role: str) -> list[PodMemory]:
        return sorted((pod for pod in self.pods.values() if pod.role == role), key=lambda pod: pod.name)


def _pod_phases(api: client.ApiClient, namespace: str) -> str:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="spark-role").items
    return ", ".join(sorted(f"{pod.metadata.name} {pod.status.phase}" for pod in pods)) or "no Spark pods yet"


def submit_and_wait(info: NodeInfo, submission: Submission, *, kubeconfig: Path, work_dir: Path) -> float:
    """spark-submit in cluster mode with `kubeconfig`'s credentials, waiting for the
    application to end (progress every PROGRESS_EVERY_S); returns the seconds from
    submit to the driver's end. Its log is work_dir/spark-submit.log."""
    log_path = work_dir / "spark-submit.log"
    command = submission.command(spark_submit_path(), info.server, work_dir / "pod-template.yaml")
    log(f"spark-submit ... {APPLICATION} {' '.join(submission.job_arguments())} (log: {log_path})")
    # Spark's Kubernetes client (fabric8) reads KUBECONFIG.
    environment = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    started = time.monotonic()
    with log_path.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
        try:
            with info.api_client() as api:
                while True:
                    try:
                        process.wait(timeout=PROGRESS_EVERY_S)
                        break
                    except subprocess.TimeoutExpired:
                        elapsed = time.monotonic() - started
                        if elapsed > SUBMIT_TIMEOUT_S:
                            raise TimeoutError(f"the Spark application ran over {SUBMIT_TIMEOUT_S:.0f}s") from None
                        with contextlib.suppress(ApiException):
                            log(f"{elapsed:5.0f}s  {_pod_phases(api, submission.namespace)}")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return time.monotonic() - started


def driver_outcome(api: client.ApiClient, submission: Submission) -> tuple[str, str]:
    """The driver pod's phase and its log (the job prints its summary as JSON on stdout)."""
    core = client.CoreV1Api(api)
    try:
        phase: str = core.read_namespaced_pod(submission.driver_pod, submission.namespace).status.phase
    except ApiException as error:
        if error.status == 404:
            raise RuntimeError("spark-submit ended without making the driver pod (see its log)") from None
        raise
    logs: str = core.read_namespaced_pod_log(submission.driver_pod, submission.namespace)
    return phase, logs


# -- the report -----------------------------------------------------------------------


def check_report(report_dir: Path, expected: Expected) -> dict[str, Any]:
    """The report's numbers and its Parquet lifecycles table against the workload; returns
    the summary. Raises AssertionError naming the first difference."""
    import pyarrow.parquet

    summary: dict[str, Any] = json.loads((report_dir / "summary.json").read_text())
    found = {
        "shards": summary["shards"],
        "sent": summary["messages_sent"],
        "deleted": summary["messages_deleted"],
        "dead_lettered": summary["messages_dead_lettered"],
        "pending": summary["messages_pending"],
        "redelivered": summary["messages_redelivered"],
        "expired": summary["messages_expired"],
        "purged": summary["messages_purged"],
        "events": summary["events"],
        "dead_letters_by_reason": summary["dead_letters_by_reason"],
    }
    wanted = {
        "shards": SHARDS,
        "sent": expected.sent,
        "deleted": expected.deleted,
        "dead_lettered": expected.dead_lettered,
        "pending": expected.pending,
        "redelivered": expected.redelivered,
        "expired": 0,
        "purged": 0,
        "events": expected.events,
        "dead_letters_by_reason": {"max_receive_count": expected.dead_lettered},
    }
    if found != wanted:
        raise AssertionError(f"the report says {found}, the workload was {wanted}")
    lifecycles = pyarrow.parquet.read_table(report_dir / "parquet" / "lifecycles")
    outcomes: dict[str, int] = {}
    for outcome in lifecycles.column("outcome").to_pylist():
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    wanted_outcomes = {
        "deleted": expected.deleted,
        "dead_lettered": expected.dead_lettered,
        "pending": expected.pending,
    }
    if outcomes != wanted_outcomes:
        raise AssertionError(f"Parquet lifecycles has outcomes {outcomes}, the workload was {wanted_outcomes}")
    if not (report_dir / "report.html").is_file():
        raise AssertionError(f"no report.html in {report_dir}")
    return summary


# -- the whole run -----------------------------------------------------------------------


def report_directory(parent: Path | None) -> Path:
    """A directory the Spark pods (user 185) can write and the host can read."""
    directory = Path(tempfile.mkdtemp(prefix="shardq-spark-report-", dir=parent))
    shutil.chown(directory, SPARK_UID, 0)
    return directory


def _delete_namespace(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    with contextlib.suppress(ApiException):
        core.delete_namespace(namespace)

    def gone() -> bool:
        try:
            core.read_namespace(namespace)
        except ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    wait_for(gone, timeout=180, what=f"namespace {namespace} deleted", interval=1)


def run(*, namespace: str, report_parent: Path | None, work_dir: Path) -> dict[str, Any]:
    """Everything in the module docstring; returns the record written to RESULTS."""
    if not namespace.startswith("spark-"):
        raise ValueError(f"the namespace must start with spark- (got {namespace})")
    layout = Layout(state_dir())
    healthy, line = status(layout)
    if not healthy:
        raise RuntimeError(f"the real node is not up ({line}): run e2e/cluster up first")
    info = NodeInfo.load(layout.info)
    started = time.monotonic()
    image = build_spark_image()
    build_s = time.monotonic() - started
    import_s = ensure_imported(layout, image)
    log(f"image {image.name}: build {build_s:.1f}s, import {import_s:.1f}s")
    report_dir = report_directory(report_parent)
    record: dict[str, Any] = {}
    with info.api_client() as api:
        recycle_released_volumes(api, layout)
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        try:
            with running_operator(info.kubeconfig, namespace, work_dir / "operator.log"):
                try:
                    record = _run_in_namespace(api, info, namespace, image.name, report_dir, work_dir)
                finally:
                    with contextlib.suppress(Exception):
                        delete_shardq(api, namespace)
        finally:
            _delete_namespace(api, namespace)
    record["image"] = {
        "name": image.name,
        "archive_bytes": image.archive.stat().st_size,
        "build_or_reuse_seconds": round(build_s, 1),
        "import_seconds": round(import_s, 1),
    }
    record["whole_run_seconds"] = round(time.monotonic() - started, 1)
    record["report_dir"] = str(report_dir)
    return record


def _run_in_namespace(
    api: client.ApiClient, info: NodeInfo, namespace: str, image: str, report_dir: Path, work_dir: Path
) -> dict[str, Any]:
    started = time.monotonic()
    install_crds(api)
    issued = make_cluster_tls_secret(api, namespace, cluster=CLUSTER, secret=TLS_SECRET, directory=work_dir / "tls")
    ca = issued.ca.read_bytes()
    create_shardq(api, namespace, info.shardq_image)
    cluster_ready_s = time.monotonic() - started
    service = naming.client_service(CLUSTER)
    service_ip = client.CoreV1Api(api).read_namespaced_service(service, namespace).spec.cluster_ip
    # From the host the Service is reached by its IP: check the name the certificate carries.
    tls = ClientTls(root_certificates=ca, server_name=client_service_name(CLUSTER, namespace))
    client.CoreV1Api(api).create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=WORKLOAD_ACCOUNT))
    )
    queue_rights.grant(api, namespace, WORKLOAD_ACCOUNT, queue=None, verbs=["send", "receive", "get"])
    token = queue_rights.account_token(api, namespace, WORKLOAD_ACCOUNT, audiences=[TOKEN_AUDIENCE])
    run_workload(f"{service_ip}:{naming.GRPC_PORT}", tls=tls, token=token)
    setup_s = time.monotonic() - started
    log(f"shardq cluster Ready in {cluster_ready_s:.1f}s, workload sent in {setup_s - cluster_ready_s:.1f}s")

    create_driver_account(api, namespace)
    # The CA is copied, as a job in another namespace than the cluster's must have it.
    client.CoreV1Api(api).create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=CA_CONFIG_MAP), data={"ca.crt": ca.decode()})
    )
    spark_token = queue_rights.account_token(api, namespace, SERVICE_ACCOUNT, audiences=[TOKEN_AUDIENCE])
    refused = refusals(f"{service_ip}:{naming.GRPC_PORT}", tls=tls, spark_token=spark_token)
    log(f"refused: {refused}")
    kubeconfig = write_submitter_kubeconfig(api, info, namespace, work_dir / "submitter.kubeconfig")
    submission = Submission(
        namespace=namespace,
        image=image,
        endpoint=in_cluster_endpoint(namespace),
        report_host_path=report_dir,
    )
    sampler = MemorySampler(info, namespace)
    with sampler.running():
        submit_s = submit_and_wait(info, submission, kubeconfig=kubeconfig, work_dir=work_dir)
    phase, driver_log = driver_outcome(api, submission)
    (work_dir / "driver.log").write_text(driver_log)
    if phase != "Succeeded":
        raise RuntimeError(f"the driver ended {phase}:\n{driver_log[-4000:]}")
    summary = check_report(report_dir / QUEUE, Expected())
    log(f"report checked: {summary['messages_sent']} sent, {summary['messages_deleted']} deleted, ...")

    def memory(pod: PodMemory) -> dict[str, Any]:
        return {
            "pod": pod.name,
            "peak_mib": round(pod.peak_bytes / 2**20, 1),
            "peak_rss_mib": round(pod.peak_rss_bytes / 2**20, 1),
            "limit_mib": round(pod.limit_bytes / 2**20),
        }

    return {
        "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "spark_conf": submission.spark_conf() | {"spark.kubernetes.container.image": image},
        "pod_template": submission.pod_template(),
        "refused": refused,
        "workload": {
            "shards": SHARDS,
            "servers": SERVERS,
            "replicas": REPLICAS,
            "processed": PROCESSED,
            "poison": POISON,
            "pending": PENDING,
        },
        "seconds": {
            "shardq_cluster_ready": round(cluster_ready_s, 1),
            "cluster_and_workload": round(setup_s, 1),
            "spark_submit_to_done": round(submit_s, 1),
        },
        "memory": {
            "driver": [memory(pod) for pod in sampler.of_role("driver")],
            "executors": [memory(pod) for pod in sampler.of_role("executor")],
        },
        "report_summary": {
            key: summary[key]
            for key in (
                "shards",
                "events",
                "messages_sent",
                "messages_deleted",
                "messages_dead_lettered",
                "messages_pending",
                "messages_redelivered",
                "latency_p50_ms",
                "latency_p99_ms",
            )
        },
        "verified": True,
    }


def summary_lines(record: dict[str, Any]) -> list[str]:
    seconds, image = record["seconds"], record["image"]
    memory = record["memory"]

    def peaks(pods: list[dict[str, Any]]) -> str:
        shown = (
            f"{pod['peak_rss_mib']} MiB RSS ({pod['peak_mib']} MiB with page cache) of {pod['limit_mib']} MiB"
            for pod in pods
        )
        return ", ".join(shown) or "none seen"

    executors, drivers = peaks(memory["executors"]), peaks(memory["driver"])
    return [
        f"image {image['name']}: build/reuse {image['build_or_reuse_seconds']} s, import {image['import_seconds']} s",
        f"shardq cluster + workload: {seconds['cluster_and_workload']} s",
        f"spark-submit -> report written: {seconds['spark_submit_to_done']} s",
        f"peak memory: driver {drivers}; executors {executors}",
        f"whole run {record['whole_run_seconds']} s; report in {record['report_dir']}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.spark_on_kubernetes", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="made and deleted by the run (spark-*)")
    parser.add_argument("--out", type=Path, default=None, help="where the report directory is made (default: /tmp)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON record")
    arguments = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="shardq-spark-run-"))
    try:
        record = run(namespace=arguments.namespace, report_parent=arguments.out, work_dir=work_dir)
    except BaseException:
        for name in ("spark-submit.log", "driver.log"):
            if (work_dir / name).exists():
                lines = (work_dir / name).read_text().splitlines()
                causes = [line for line in lines if "Exception" in line or "Caused by" in line or "Error" in line]
                print(f"--- {name}: first errors, then the last lines", *causes[:10], *lines[-15:], sep="\n")
        print(f"logs kept in {work_dir}", file=sys.stderr)
        raise
    shutil.rmtree(work_dir)
    arguments.results.parent.mkdir(parents=True, exist_ok=True)
    arguments.results.write_text(json.dumps(record, indent=2) + "\n")
    for line in summary_lines(record):
        print(line)
    print(f"recorded in {arguments.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
