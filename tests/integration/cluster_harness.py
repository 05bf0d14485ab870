"""A replicated cluster of real shard servers for tests: a cluster file, a local lease
store with one lease per shard, and `shardq serve` processes stopped by PID.

Takeovers are done by the tests themselves, exactly as the supervisor or the
operator would (lease compare-and-swap), so each test controls the timing.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from shard_server.leases.store import ISR_ANNOTATION, LeaseRecord
from shard_server.storage.lease_store import LocalLeaseStore
from tests.integration.harness import free_port

LEASE_MS = 1_500
SERVERS = ("s1", "s2", "s3")
PLACEMENT = [["s1", "s2", "s3"], ["s2", "s3", "s1"]]


class Cluster:
    def __init__(
        self,
        root: pathlib.Path,
        *,
        placement: list[list[str]] | None = None,
        spec: dict[str, object] | None = None,
    ) -> None:
        self.root = root
        self.placement = placement or PLACEMENT
        servers = sorted({server for replicas in self.placement for server in replicas})
        self.servers = servers
        self.ports = {server: free_port() for server in servers}
        self.metrics_ports = {server: free_port() for server in servers}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.cluster_file = root / "cluster.json"
        self.cluster_file.write_text(
            json.dumps(
                {
                    "servers": {s: {"address": self.endpoint(s)} for s in servers},
                    "queues": [
                        {
                            "name": "orders",
                            "spec": {"shards": len(self.placement), "replicas": len(self.placement[0]), **(spec or {})},
                        }
                    ],
                    "placement": {"orders": self.placement},
                    "lease_duration_ms": LEASE_MS,
                }
            )
        )
        self.leases = LocalLeaseStore(root / "leases.lmdb")
        now = int(time.time() * 1000)
        for shard, replicas in enumerate(self.placement):
            self.leases.create(
                LeaseRecord(
                    name=f"orders.{shard}",
                    holder=replicas[0],
                    acquire_time_ms=now,
                    renew_time_ms=now,
                    duration_ms=LEASE_MS,
                    transitions=1,
                    annotations={ISR_ANNOTATION: ",".join(sorted(replicas))},
                )
            )

    def endpoint(self, server: str) -> str:
        return f"127.0.0.1:{self.ports[server]}"

    def start(self, server: str) -> None:
        log = (self.root / f"{server}.log").open("ab")
        command = [
            sys.executable, "-m", "shardq", "serve",
            "--cluster-file", str(self.cluster_file), "--server-id", server,
            "--lease-store", str(self.root / "leases.lmdb"), "--data-dir", str(self.root / server),
            "--port", str(self.ports[server]), "--metrics-port", str(self.metrics_ports[server]),
            "--log-format", "text",
        ]  # fmt: skip
        self.processes[server] = subprocess.Popen(command, stdout=log, stderr=log)
        log.close()

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
        self.leases.close()

    def leader_of(self, shard: int) -> LeaseRecord:
        lease = self.leases.get(f"orders.{shard}")
        assert lease is not None
        return lease
