"""`shardq analytics report` against a down server or an unknown queue: one line that
says what to check, before any Spark starts, and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

from tests.support.ports import free_port
from tests.support.servers import ServerProcess


def report(endpoint: str, queue: str, out: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardq", "analytics", "report", "--endpoint", endpoint, "--queue", queue, "--out", out],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_down_server_and_an_unknown_queue_are_one_line_each(server: ServerProcess, tmp_path: object) -> None:
    closed = f"127.0.0.1:{free_port()}"
    for endpoint, queue, expected in (
        (closed, "orders", f"no shardq server at {closed}"),
        (server.endpoint, "nope", "queue 'nope' does not exist"),
    ):
        done = report(endpoint, queue, str(tmp_path))
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert expected in lines[0]
        assert "Traceback" not in done.stderr
        assert "AnalysisException" not in done.stderr
