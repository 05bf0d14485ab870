"""The operator as a process on the host, talking to a test cluster's API server
(`shardq operator --namespace NS --kubeconfig K`), stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_DEADLINE_S = 15.0


@contextmanager
def running_operator(
    kubeconfig: Path, namespace: str, log_path: Path, *, metrics_port: int = 0, identity: str = ""
) -> Iterator[subprocess.Popen[bytes]]:
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardq_operator",
                "--namespace",
                namespace,
                "--kubeconfig",
                str(kubeconfig),
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(metrics_port),
                *(("--identity", identity) if identity else ()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
