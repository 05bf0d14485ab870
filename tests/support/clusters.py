"""A replicated cluster of real shard servers for tests: a cluster file, a local lease
store with one lease per shard, and `shardq serve` processes stopped by PID.

Takeovers are done by the tests themselves, exactly as the supervisor or the
operator would (lease compare-and-swap), so each test controls the timing.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import grpc

from shardq import Client, Message, SendResult
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.cluster_map import (
    CLUSTER_FILE,
    ClusterMap,
    QueueEntry,
    ServerEntry,
    lease_name,
    write_cluster_map,
)
from shardq.coordination.kubernetes_leases import KubernetesLeaseStore, connect
from shardq.coordination.leases import LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import lease_for_new_shard
from shardq.errors import NotLeader, ShardqError, Unavailable
from tests.support.ports import free_port
from tests.support.servers import wait_for

LEASE_MS = 1_500
SERVERS = ("s1", "s2", "s3")
PLACEMENT = [["s1", "s2", "s3"], ["s2", "s3", "s1"]]
# Three shards, each led by its placement's first server: s1, s2, s3.
THREE_LEADERS = [["s1", "s2"], ["s2", "s3"], ["s3", "s1"]]


@dataclasses.dataclass(frozen=True)
class KubernetesLeases:
    """Where a cluster's shard leases live when they are Lease objects."""

    kubeconfig: pathlib.Path
    namespace: str
    # Whether the servers read Leases from a watch (the default) or with a GET per read.
    watch: bool = True

    def store(self) -> KubernetesLeaseStore:
        # Direct reads: the test plays the supervisor, and sees each write at once.
        return KubernetesLeaseStore(connect(kubeconfig=self.kubeconfig), namespace=self.namespace, watch=False)


class Cluster:
    def __init__(
        self,
        root: pathlib.Path,
        *,
        placement: list[list[str]] | None = None,
        spec: dict[str, object] | None = None,
        lease_ms: int = LEASE_MS,
        kubernetes: KubernetesLeases | None = None,
        spare_servers: tuple[str, ...] = (),
        more_queues: Sequence[tuple[QueueEntry, list[list[str]]]] = (),
        server_args: Sequence[str] = (),
        uid: str = "",
    ) -> None:
        """A local lease file by default; with `kubernetes`, Lease objects in its namespace.
        `spare_servers` are in the map but hold no replica (yet): room to move replicas to.
        `more_queues`: queues besides `orders`, each with its placement. `server_args`:
        more `shardq serve` options for every server. `uid`: which creation of `orders`
        the map names (none by default)."""
        self.server_args = tuple(server_args)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.lease_ms = lease_ms
        self.kubernetes = kubernetes
        self.placement = placement or PLACEMENT
        placed = [*self.placement, *(replicas for _, placement in more_queues for replicas in placement)]
        servers = sorted({server for replicas in placed for server in replicas} | set(spare_servers))
        self.servers = servers
        self.ports = {server: free_port() for server in servers}
        self.metrics_ports = {server: free_port() for server in servers}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.leases: LeaseStore
        if kubernetes is None:
            self.leases = self._local = LocalLeaseStore(root / "leases")
            self.lease_store_args = ["--lease-store", str(root / "leases")]
        else:
            self.leases = self._kubernetes = kubernetes.store()
            self.lease_store_args = [
                "--lease-store", "kubernetes", "--kubeconfig", str(kubernetes.kubeconfig),
                "--namespace", kubernetes.namespace, *(() if kubernetes.watch else ("--no-lease-watch",)),
            ]  # fmt: skip
        self.cluster_file = root / CLUSTER_FILE
        self.cluster_map = seed_cluster(
            self.cluster_file,
            self.leases,
            servers={server: self.endpoint(server) for server in servers},
            queue=QueueEntry(
                "orders", {"shards": len(self.placement), "replicas": len(self.placement[0]), **(spec or {})}, uid=uid
            ),
            placement=self.placement,
            lease_duration_ms=lease_ms,
            more_queues=more_queues,
        )

    def endpoint(self, server: str) -> str:
        return f"127.0.0.1:{self.ports[server]}"

    def start(self, server: str) -> None:
        log = (self.root / f"{server}.log").open("ab")
        command = [
            sys.executable, "-m", "shardq", "serve",
            "--cluster-file", str(self.cluster_file), "--server-id", server,
            *self.lease_store_args, "--data-dir", str(self.root / server),
            "--port", str(self.ports[server]), "--metrics-port", str(self.metrics_ports[server]),
            "--log-format", "text", *self.server_args,
        ]  # fmt: skip
        self.processes[server] = subprocess.Popen(command, stdout=log, stderr=log)
        log.close()

    def log(self, server: str) -> str:
        """What `server` has logged, in every run of it."""
        return (self.root / f"{server}.log").read_text()

    def metrics_url(self, server: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[server]}/metrics"

    def kill(self, server: str) -> None:
        process = self.processes.pop(server)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        if self.kubernetes is None:
            self._local.close()
        else:
            self._kubernetes.close()

    def leader_of(self, shard: int) -> LeaseRecord:
        lease = self.leases.get(lease_name(ShardId("orders", shard)))
        assert lease is not None
        return lease


def every_shard_led(stub: queue_pb2_grpc.QueueServiceStub, *, queue: str = "orders", shards: int = 3) -> bool:
    """Whether the server behind `stub` counts every shard of `queue`: each has a leader
    that answers (False while the servers start)."""
    try:
        attributes = stub.GetQueueAttributes(queue_pb2.GetQueueAttributesRequest(queue=queue), timeout=5)
    except grpc.RpcError:
        return False
    return [shard.shard for shard in attributes.shards] == list(range(shards))


def running(cluster: Cluster) -> Iterator[Cluster]:
    """`cluster` with every server started, stopped after the test whatever happened
    (for fixtures: `yield from running(Cluster(...))`)."""
    try:
        for server in cluster.servers:
            cluster.start(server)
        yield cluster
    finally:
        cluster.stop_all()


def seed_cluster(
    path: pathlib.Path,
    leases: LeaseStore,
    *,
    servers: dict[str, str],
    queue: QueueEntry,
    placement: list[list[str]],
    lease_duration_ms: int,
    now_ms: int | None = None,
    more_queues: Sequence[tuple[QueueEntry, list[list[str]]]] = (),
) -> ClusterMap:
    """Write a cluster map of `queue` (and `more_queues`) to `path` and each shard's first
    lease, as the supervisor or the operator would: the placement's first replica leads in epoch 1."""
    cluster = ClusterMap(
        servers={server: ServerEntry(server, address) for server, address in servers.items()},
        queues=[queue, *(entry for entry, _ in more_queues)],
        placement={queue.name: placement, **{entry.name: more for entry, more in more_queues}},
        lease_duration_ms=lease_duration_ms,
    )
    write_cluster_map(path, cluster)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    for shard in cluster.shards():
        record = lease_for_new_shard(
            None,
            shard=shard,
            replicas=cluster.replicas_of(shard),
            now_ms=now,
            duration_ms=lease_duration_ms,
            queue_uid=cluster.queue_uid(shard.queue),
        )
        try:
            leases.create(record)
        except LeaseConflict:
            raise AssertionError(f"lease {record.name} exists already: seed a fresh lease store") from None
    return cluster


def send_once_led(client: Client, body: bytes, *, queue: str = "orders") -> SendResult:
    """One send, retried while the servers just started come up and take leadership."""

    def attempt() -> SendResult | None:
        try:
            (sent,) = client.send_messages(queue, [Message(body)])
        except (Unavailable, NotLeader):
            return None
        return sent

    return wait_for(attempt, timeout=30, interval=0.1, what=f"{queue} led")


def send_until_accepted(client: Client, bodies: list[bytes], *, shard_hint: str) -> list[str]:
    """Send through any server, retrying while leadership settles; returns acknowledged ids."""

    def attempt() -> list[str] | None:
        try:
            results = client.send_messages("orders", [Message(body) for body in bodies])
        except ShardqError:  # the cluster is electing: retry until the deadline
            return None
        if all(result.ok for result in results):
            return [result.message_id for result in results]
        return None

    return wait_for(attempt, timeout=30, interval=0.2, what=f"sends accepted ({shard_hint})")
