"""`shardq local up` as a subprocess, driven the way an operator would: by PID and signal.

Everything a test learns about the cluster comes from the supervisor's output and
`shardq local status --json`; every server PID ever seen is remembered so that
`cleanup()` can stop exactly those processes (and only while they still run this
cluster's servers: PIDs get reused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from shard_server.local.processes import is_cluster_server, process_is_alive
from tests.support.ports import free_port_block
from tests.support.servers import wait_for

T = TypeVar("T")

START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0
STATUS_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True, slots=True)
class ShardStatus:
    queue: str
    shard: int
    leader: str
    epoch: int
    isr: tuple[str, ...]
    replicas: tuple[str, ...]
    lease_expired: bool

    @property
    def lease(self) -> str:
        return f"{self.queue}.{self.shard}"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerStatus:
    server_id: str
    endpoint: str
    pid: int
    alive: bool
    answering: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterStatus:
    servers: dict[str, ServerStatus]
    shards: dict[str, ShardStatus]
    raw: dict[str, Any]

    def led_by(self, server_id: str) -> list[ShardStatus]:
        return [shard for shard in self.shards.values() if shard.leader == server_id]


def cluster_status_from_json(data: dict[str, Any]) -> ClusterStatus:
    servers = {
        s["server_id"]: ServerStatus(s["server_id"], s["endpoint"], int(s["pid"] or 0), s["alive"], s["answering"])
        for s in data["servers"]
    }
    shards = {}
    for s in data["shards"]:
        shard = ShardStatus(
            queue=s["queue"],
            shard=int(s["shard"]),
            leader=s["leader"] or "",
            epoch=int(s["epoch"]),
            isr=tuple(s["isr"]),
            replicas=tuple(s["replicas"]),
            lease_expired=bool(s["lease_expired"]),
        )
        shards[shard.lease] = shard
    return ClusterStatus(servers, shards, data)


@dataclasses.dataclass
class LocalCluster:
    data_dir: pathlib.Path
    queues: Sequence[str]
    servers: int = 3
    lease_duration: str = "2s"
    base_port: int = 0
    metrics_base_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    runs: int = 0
    # pid -> server id of every server process this cluster ever showed.
    seen_server_pids: dict[int, str] = dataclasses.field(default_factory=dict)
    # What happened when, for failure reports: (wall ms, event).
    events: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    _endpoints: list[str] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.base_port:
            self.base_port, self.metrics_base_port = free_port_block(self.servers)

    # -- files -----------------------------------------------------------------------------

    @property
    def stdout_path(self) -> pathlib.Path:
        return self.data_dir.parent / f"supervisor-{self.runs}.out"

    @property
    def stderr_path(self) -> pathlib.Path:
        return self.data_dir.parent / f"supervisor-{self.runs}.err"

    def server_data_dir(self, server_id: str) -> pathlib.Path:
        return self.data_dir / "servers" / server_id

    def output(self, *, tail: int = 60) -> str:
        parts = []
        for run in range(1, self.runs + 1):
            for kind in ("out", "err"):
                path = self.data_dir.parent / f"supervisor-{run}.{kind}"
                if path.exists():
                    lines = path.read_text(errors="replace").splitlines()[-tail:]
                    parts.append(f"--- supervisor run {run} std{kind} (last {tail} lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    def note(self, event: str) -> None:
        self.events.append((time.time_ns() // 1_000_000, event))

    def timeline(self) -> str:
        return "\n".join(f"{wall} {event}" for wall, event in self.events)

    # -- lifecycle ---------------------------------------------------------------------------

    def up(self) -> None:
        self.runs += 1
        command = [
            sys.executable, "-m", "shardq", "local", "up",
            "--data-dir", str(self.data_dir),
            "--servers", str(self.servers),
            "--base-port", str(self.base_port),
            "--metrics-base-port", str(self.metrics_base_port),
            "--lease-duration", self.lease_duration,
        ]  # fmt: skip
        for queue in self.queues:
            command += ["--queue", queue]
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.note(f"supervisor run {self.runs} started (pid {self.process.pid})")
        wait_for(self._printed_servers, timeout=START_DEADLINE_S, what=f"server lines\n{self.output()}")
        self.wait_healthy(what="cluster up")

    def _printed_servers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the supervisor exited with {self.process.returncode}:\n{self.output()}")
        lines = [line.split() for line in self.stdout_path.read_text().splitlines() if " pid " in line]
        for fields in lines:
            self.seen_server_pids[int(fields[fields.index("pid") + 1])] = fields[0]
        if len(lines) < self.servers:
            return False
        with self._lock:
            self._endpoints = [fields[1] for fields in lines[: self.servers]]
        return True

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def status(self) -> ClusterStatus:
        result = subprocess.run(
            [sys.executable, "-m", "shardq", "local", "status", "--data-dir", str(self.data_dir), "--json"],
            capture_output=True,
            timeout=STATUS_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise AssertionError(f"`shardq local status` failed ({result.returncode}): {result.stderr.decode()}")
        status = cluster_status_from_json(json.loads(result.stdout))
        for server in status.servers.values():
            if server.pid:
                self.seen_server_pids[server.pid] = server.server_id
        return status

    def healthy(self) -> ClusterStatus | None:
        """The status if every server answers and every shard has a live leader, else None."""
        status = self.status()
        if not all(s.alive and s.answering for s in status.servers.values()):
            return None
        if not all(shard.leader and not shard.lease_expired for shard in status.shards.values()):
            return None
        return status

    def wait_healthy(self, *, what: str, timeout: float = START_DEADLINE_S) -> ClusterStatus:
        status = wait_for(self.healthy, timeout=timeout, what=f"{what}: a healthy cluster\n{self.output()}")
        self.note(f"healthy: {self.describe(status)}")
        return status

    @staticmethod
    def describe(status: ClusterStatus) -> str:
        shards = ", ".join(f"{s.lease}={s.leader}@{s.epoch} isr={'/'.join(s.isr)}" for s in status.shards.values())
        servers = ", ".join(f"{s.server_id}:{s.pid}" for s in status.servers.values())
        return f"servers {servers}; shards {shards}"

    def signal_server(self, server_id: str, pid: int, signum: signal.Signals) -> None:
        if not is_cluster_server(pid, data_dir=self.data_dir, server_id=server_id):
            raise AssertionError(f"pid {pid} is no longer server {server_id}")
        os.kill(pid, signum)
        self.note(f"{signum.name} {server_id} (pid {pid})")

    def pause_supervisor(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.note("SIGSTOP supervisor")

    def resume_supervisor(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self.note("SIGCONT supervisor")

    def wipe_server_data(self, server_id: str) -> None:
        shutil.rmtree(self.server_data_dir(server_id))
        self.note(f"deleted {self.server_data_dir(server_id)}")

    def terminate(self) -> int:
        """SIGTERM the supervisor (it stops its servers) and wait; returns its exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.note("SIGTERM supervisor")
        code = self.process.wait(timeout=STOP_DEADLINE_S)
        self.note(f"supervisor exited with {code}")
        return code

    def cleanup(self) -> None:
        """Stop the supervisor and every server process it ever showed, by PID."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_DEADLINE_S)
        for pid, server_id in self.seen_server_pids.items():
            if is_cluster_server(pid, data_dir=self.data_dir, server_id=server_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        leftovers = [pid for pid in self.seen_server_pids if process_is_alive(pid)]
        wait_for(
            lambda: (
                not any(
                    is_cluster_server(pid, data_dir=self.data_dir, server_id=self.seen_server_pids[pid])
                    for pid in leftovers
                )
            ),
            timeout=STOP_DEADLINE_S,
            what="every server process to exit",
        )
