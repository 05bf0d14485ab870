"""The `shardq` command line against a real server: send, receive, delete, stats, purge, errors."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.harness import ServerProcess

QUEUE = "orders-dlq"


def shardq(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardq", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"SHARDQ_ENDPOINT": server.endpoint, "PATH": "/usr/bin:/bin"},
    )


def ok(server: ServerProcess, *args: str) -> str:
    done = shardq(server, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def stats(server: ServerProcess) -> dict[str, int]:
    data = json.loads(ok(server, "stats", "--queue", QUEUE, "--json"))
    assert data["queue"] == QUEUE
    return {key: data[key] for key in ("visible", "in_flight", "delayed")}


def test_send_receive_delete_stats_purge(server: ServerProcess) -> None:
    sent = json.loads(ok(server, "send", "--queue", QUEUE, "--body", "hello", "--attr", "k=v", "--json"))
    assert sent["duplicate"] is False
    assert stats(server) == {"visible": 1, "in_flight": 0, "delayed": 0}

    lines = ok(server, "receive", "--queue", QUEUE, "--visibility", "60s", "--json").splitlines()
    assert len(lines) == 1
    received = json.loads(lines[0])
    assert (received["id"], received["body"], received["attributes"]) == (sent["id"], "hello", {"k": "v"})
    assert stats(server) == {"visible": 0, "in_flight": 1, "delayed": 0}

    assert ok(server, "delete", "--queue", QUEUE, "--receipt", received["receipt"]).strip() == "deleted 1"
    assert stats(server) == {"visible": 0, "in_flight": 0, "delayed": 0}

    for i in range(3):
        ok(server, "send", "--queue", QUEUE, "--body", f"m{i}")
    ok(server, "send", "--queue", QUEUE, "--body", "later", "--delay", "20m")
    assert stats(server) == {"visible": 3, "in_flight": 0, "delayed": 1}
    assert ok(server, "purge", "--queue", QUEUE).strip() == "purged 4"
    assert stats(server) == {"visible": 0, "in_flight": 0, "delayed": 0}


def test_errors_exit_non_zero_with_a_one_line_reason(server: ServerProcess) -> None:
    cases = [
        (("receive", "--queue", "nope"), "QUEUE_NOT_FOUND"),
        (("stats", "--queue", "nope", "--json"), "QUEUE_NOT_FOUND"),
        (("send", "--queue", "fifo", "--body", "no group"), "messages[0].group_id"),
        (("delete", "--queue", QUEUE, "--receipt", "junk"), "MALFORMED_RECEIPT"),
    ]
    for args, expected in cases:
        done = shardq(server, *args)
        assert done.returncode != 0, args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, (args, done.stderr)
        assert expected in lines[0], (args, lines[0])
        assert "Traceback" not in done.stderr
