"""The operator as a process on the host, talking to a test cluster's API server
(`shardq operator --namespace NS --kubeconfig K --peer-key-file F`), stopped by PID.

Every operator of a namespace gets the same peer key (as the chart's replicas share one
Secret), so a standby that takes over derives the clusters' peer secrets unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from shardq.coordination.peer_credentials import new_peer_secret, write_peer_secret

STOP_DEADLINE_S = 15.0


def peer_key_file(kubeconfig: Path, namespace: str) -> Path:
    """The peer key of the operators of `namespace`, made on first use."""
    path = kubeconfig.parent / f"operator-peer-key-{namespace}"
    if not path.exists():
        write_peer_secret(path, new_peer_secret())
    return path


@contextmanager
def running_operator(
    kubeconfig: Path,
    namespace: str,
    log_path: Path,
    *,
    metrics_port: int = 0,
    identity: str = "",
    extra_args: Sequence[str] = (),
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
                "--peer-key-file",
                str(peer_key_file(kubeconfig, namespace)),
                *(("--identity", identity) if identity else ()),
                *extra_args,
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
