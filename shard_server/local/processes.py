"""Server processes of a local cluster: started, watched and stopped by PID, never by name.

Each server runs in its own session, so a Ctrl-C in the supervisor's terminal reaches
the supervisor alone and the servers stop in the order it chooses (SIGTERM, then
SIGKILL after a deadline). Output goes to one log file per server, appended across
restarts; readiness is the server's own ready line (printed once its replicas are in
sync, see runtime.readiness), read from that log.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from shard_server.local.cluster_files import LEASE_STORE_DIR, PEER_SECRET_FILE
from shard_server.runtime.readiness import READY_LINE
from shardq.coordination.cluster_map import CLUSTER_FILE, ServerEntry

FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 10.0
# Where progress lines go: the supervisor's log.
ReportFn = Callable[[str], None]
# A server that stayed up this long is healthy again: its next crash restarts it quickly.
STABLE_AFTER_S = 30.0


def build_server_command(*, data_dir: pathlib.Path, server: ServerEntry) -> list[str]:
    return [
        sys.executable, "-m", "shardq", "serve",
        "--cluster-file", str(data_dir / CLUSTER_FILE),
        "--server-id", server.server_id,
        "--lease-store", str(data_dir / LEASE_STORE_DIR),
        "--data-dir", str(server_data_dir(data_dir, server.server_id)),
        "--port", str(server.port),
        "--metrics-port", str(server.metrics_port),
        "--log-format", "json",
        "--peer-secret-file", str(data_dir / PEER_SECRET_FILE),
    ]  # fmt: skip


def server_data_dir(data_dir: pathlib.Path, server_id: str) -> pathlib.Path:
    return data_dir / "servers" / server_id


def server_log_path(data_dir: pathlib.Path, server_id: str) -> pathlib.Path:
    return data_dir / "logs" / f"{server_id}.log"


@dataclasses.dataclass
class ManagedServer:
    """One server id and the process currently running it (if any), with its restart backoff."""

    entry: ServerEntry
    command: Sequence[str]
    log_path: pathlib.Path
    process: subprocess.Popen[bytes] | None = None
    started_at_ms: int = 0  # wall clock, comparable with lease acquire times
    started_monotonic: float = 0.0
    ready_since_ms: int | None = None
    restarts: int = 0
    restart_delay_s: float = FIRST_RESTART_DELAY_S
    restart_due: float | None = None  # monotonic time of the next start attempt, while down
    last_exit_code: int | None = None
    _log_offset: int = 0

    @property
    def server_id(self) -> str:
        return self.entry.server_id

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.ready_since_ms = None
        self.restart_due = None
        self.last_exit_code = None
        self.started_at_ms = wall_clock_ms()
        self.started_monotonic = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                list(self.command), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def check_exited(self) -> int | None:
        """The exit code if the process exited since the last check (it is reaped), else None.

        Schedules the restart with a backoff that doubles while the server keeps crashing.
        """
        if self.process is None or self.restart_due is not None:
            return None
        code = self.process.poll()
        if code is None:
            return None
        self.last_exit_code = code
        if time.monotonic() - self.started_monotonic >= STABLE_AFTER_S:
            self.restart_delay_s = FIRST_RESTART_DELAY_S
        self.restart_due = time.monotonic() + self.restart_delay_s
        self.restart_delay_s = min(self.restart_delay_s * 2, MAX_RESTART_DELAY_S)
        return code

    def seconds_until_restart(self) -> float:
        return 0.0 if self.restart_due is None else max(0.0, self.restart_due - time.monotonic())

    def restart_is_due(self) -> bool:
        return self.restart_due is not None and time.monotonic() >= self.restart_due

    def check_ready(self) -> bool:
        """True once the current process has printed its ready line."""
        if self.ready_since_ms is not None:
            return True
        if not self.running():
            return False
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            if READY_LINE.encode() in log.read():
                self.ready_since_ms = wall_clock_ms()
        return self.ready_since_ms is not None

    def last_log_line(self, *, max_chars: int = 300) -> str:
        """The last line the current (or just exited) process wrote: usually why it exited."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(self._log_offset, size - 4096))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:max_chars] if lines else ""

    def send_signal(self, signum: signal.Signals) -> None:
        if self.running() and self.process is not None:
            os.kill(self.process.pid, signum)


def stop_servers(servers: Sequence[ManagedServer], *, deadline_s: float, report: ReportFn) -> None:
    """SIGTERM every running server, wait up to `deadline_s` for all, SIGKILL the rest."""
    running = [server for server in servers if server.running()]
    for server in running:
        report(f"stopping {server.server_id} (pid {server.pid})")
        server.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + deadline_s
    while any(server.running() for server in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for server in running:
        if server.running():
            report(f"{server.server_id} (pid {server.pid}) ignored SIGTERM for {deadline_s:.0f}s: SIGKILL")
            server.send_signal(signal.SIGKILL)
            if server.process is not None:
                server.process.wait(timeout=deadline_s)


def ports_taken(servers: Sequence[ServerEntry]) -> list[str]:
    """What holds a port one of `servers` would listen on, a line each. A server that
    cannot listen was restarted with back-off for good, and `up` never said why."""
    taken = []
    for server in servers:
        for kind, address in (("gRPC", server.address), ("metrics", server.metrics_address)):
            if not address:
                continue
            host, _, port = address.rpartition(":")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                # As gRPC and the metrics server bind: a port in TIME_WAIT is not taken.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((host or "127.0.0.1", int(port)))
                except OSError as error:
                    # Only a port in use: an address this probe cannot bind for another
                    # reason (not IPv4, not this host's) is left to the server to report.
                    if error.errno == errno.EADDRINUSE:
                        taken.append(f"{server.server_id}'s {kind} address {address}: {error.strerror}")
    return taken


def process_is_alive(pid: int) -> bool:
    """True if `pid` names a process that has not exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = pathlib.Path(f"/proc/{pid}/stat")
    try:
        # The state letter follows the parenthesised command name, which may itself hold spaces.
        state = stat.read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def is_cluster_server(pid: int, *, data_dir: pathlib.Path, server_id: str) -> bool:
    """True if `pid` is alive and runs server `server_id` of the cluster in `data_dir`.

    Pids are reused: a pid from an old supervisor record proves nothing by itself.
    """
    if not process_is_alive(pid):
        return False
    try:
        arguments = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    expected = [b"--server-id", server_id.encode(), b"--cluster-file", str(data_dir / CLUSTER_FILE).encode()]
    return all(part in arguments for part in expected)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000
