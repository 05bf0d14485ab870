"""A real `shardq serve` subprocess, and polling/draining helpers."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from shardq import Client, ReceivedMessage
from tests.support.ports import free_port

T = TypeVar("T")

READY_LINE = "shardq: listening on"
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0

DEFAULT_QUEUES = (
    "orders:shards=4,dead_letter_queue=orders-dlq,max_receive_count=2",
    "orders-dlq",
    "fifo:fifo=true,shards=2",
)


def wait_for(check: Callable[[], T | None], *, timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclasses.dataclass
class ServerProcess:
    """A `shardq serve` subprocess on a fixed port and data directory."""

    data_dir: pathlib.Path
    queues: Sequence[str]
    port: int
    metrics_port: int
    log_path: pathlib.Path
    # More `shardq serve` options, e.g. ("--writer-threads", "2").
    extra_args: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None
    # The loopback address the server listens on (any of 127.0.0.0/8).
    host: str = "127.0.0.1"
    # What Python runs in place of `-m shardq`: a script taking the same arguments
    # (tests/support/losing_claims.py, a server that loses chosen claims).
    launcher: Sequence[str] = ("-m", "shardq")

    @classmethod
    def in_directory(cls, directory: pathlib.Path, queues: Sequence[str], *extra_args: str) -> ServerProcess:
        """A server (not started) with its data and log in `directory`, on fresh ports."""
        return cls(
            data_dir=directory / "data",
            queues=queues,
            port=free_port(),
            metrics_port=free_port(),
            log_path=directory / "server.log",
            extra_args=extra_args,
        )

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        command = [
            sys.executable,
            *self.launcher,
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--map-size",
            "256MiB",
            "--log-format",
            "text",
        ]
        for spec in self.queues:
            command += ["--queue", spec]
        return command + list(self.extra_args)

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "server already running"
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_ready(offset)

    def _wait_ready(self, offset: int) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if READY_LINE in self.log()[offset:]:
                with socket.socket() as sock:
                    if sock.connect_ex((self.host, self.port)) == 0:
                        return
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {START_DEADLINE_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: no chance to flush or shut down."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_DEADLINE_S)

    def stop(self) -> int:
        """SIGTERM and wait for a graceful exit; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_DEADLINE_S)
                raise AssertionError(f"server ignored SIGTERM for {STOP_DEADLINE_S}s:\n{self.log()}") from None
        return int(self.process.returncode)

    def restart(self) -> None:
        """Start again on the same data directory and ports (after kill() or stop())."""
        if self.process is not None and self.process.poll() is None:
            self.stop()
        self.start()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_DEADLINE_S)


ServerFactory = Callable[..., ServerProcess]


def drain(client: Client, queue: str, *, visibility_timeout_ms: int = 60_000) -> list[ReceivedMessage]:
    """Receive and delete everything visible now; returns what was received."""
    received: list[ReceivedMessage] = []
    while True:
        batch = client.receive_messages(queue, max_messages=1000, visibility_timeout_ms=visibility_timeout_ms)
        if not batch:
            return received
        results = client.delete_messages(queue, [m.receipt for m in batch])
        assert all(r.ok for r in results), results
        received.extend(batch)


def peek_all(client: Client, queue: str, *, visibility_timeout_ms: int = 60_000) -> list[ReceivedMessage]:
    """Receive everything visible now without deleting it (it stays in flight)."""
    received: list[ReceivedMessage] = []
    while True:
        batch = client.receive_messages(queue, max_messages=1000, visibility_timeout_ms=visibility_timeout_ms)
        if not batch:
            return received
        received.extend(batch)


def stored_count(client: Client, queue: str) -> int:
    attributes = client.attributes(queue)
    return attributes.visible + attributes.in_flight + attributes.delayed + attributes.dead_letter_pending


def wait_in_flight(client: Client, queue: str, count: int, *, timeout: float = 5.0) -> None:
    """Wait until attributes show `count` messages in flight.

    Receives are answered before their claim is committed, so attributes read
    right after a receive may not count it yet.
    """
    wait_for(lambda: client.attributes(queue).in_flight == count, timeout=timeout, what=f"{count} in flight")
