"""The `shardq` command line as a user runs it: a process of its own against a server."""

from __future__ import annotations

import subprocess
import sys


def run_shardq(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`shardq ARGS --endpoint ENDPOINT`, its exit code and output (text), never raising
    for a non-zero exit: the refusals are what some tests check."""
    return subprocess.run(
        [sys.executable, "-m", "shardq", *args, "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
