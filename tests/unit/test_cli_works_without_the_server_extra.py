"""`pip install shardq` (or `shardq[spark]`, as the Spark image does) gives a working
CLI and analytics job: the commands that need the server's extra say so when run
instead of breaking every other command at import."""

from __future__ import annotations

import subprocess
import sys

# lmdb (the server extra) made unimportable, as on a machine without it.
WITHOUT_LMDB = "import sys; sys.modules['lmdb'] = None; from shardq.cli import main; main()"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_LMDB, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_client_commands_work_without_lmdb() -> None:
    shown = run_cli("--help")
    assert shown.returncode == 0, shown.stderr
    assert "send" in shown.stdout
    assert "serve" in shown.stdout  # listed, and marked as needing an extra


def test_a_server_command_says_which_extra_it_needs() -> None:
    refused = run_cli("serve", "--data-dir", "/nonexistent")
    assert refused.returncode == 1
    assert "needs lmdb" in refused.stderr
    assert "pip install 'shardq[server,operator]'" in refused.stderr


def test_the_analytics_job_explains_a_down_server_without_lmdb() -> None:
    # Port 1 on loopback: nothing listens, the job says so in one line before Spark starts.
    code = (
        "import sys; sys.modules['lmdb'] = None; from shardq.analytics.job import main; "
        "sys.exit(main(['--endpoint', '127.0.0.1:1', '--queue', 'orders', '--out', 'unused']))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.startswith("shardq analytics:"), ran.stderr
