"""The `shardq` command line against a real server: send, receive, delete, stats, purge, errors."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

from tests.support.ports import free_port
from tests.support.servers import ServerProcess

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

    assert ok(server, "delete", "--queue", QUEUE, "--receipt", received["receipt"]).startswith("deleted\t")
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


def test_delete_reports_each_receipt_and_deletes_the_good_ones(server: ServerProcess) -> None:
    for body in ("first", "second"):
        ok(server, "send", "--queue", QUEUE, "--body", body)
    received = [
        json.loads(line)
        for line in ok(server, "receive", "--queue", QUEUE, "--max", "2", "--visibility", "60s", "--json").splitlines()
    ]
    assert len(received) == 2
    good, other = received[0]["receipt"], received[1]["receipt"]

    done = shardq(server, "delete", "--queue", QUEUE, "--receipt", good, "--receipt", "junk", "--receipt", other)
    assert done.returncode != 0
    outcomes = [line.split("\t")[0] for line in done.stdout.splitlines()]
    assert outcomes == ["deleted", "failed", "deleted"]
    assert "MALFORMED_RECEIPT" in done.stdout.splitlines()[1]
    assert done.stderr.strip().splitlines() == [
        "Error: 1 of 3 deletes failed: MALFORMED_RECEIPT (the others were deleted)"
    ]
    assert stats(server) == {"visible": 0, "in_flight": 0, "delayed": 0}

    # Deleting again with a receipt whose message is gone says so.
    again = shardq(server, "delete", "--queue", QUEUE, "--receipt", good)
    assert again.returncode != 0
    assert "MESSAGE_NOT_FOUND" in again.stdout
    assert "no longer stored (deleted, expired or dead-lettered)" in again.stdout


def test_connection_problems_say_what_to_check(server: ServerProcess) -> None:
    closed = f"127.0.0.1:{free_port()}"
    metrics = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    for endpoint, expected in (
        (closed, f"no shardq server at {closed} (connection refused)"),
        (metrics, f"{metrics} is not a shardq gRPC endpoint"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "shardq", "receive", "--queue", QUEUE, "--endpoint", endpoint],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert expected in lines[0]


def test_serve_on_a_port_in_use_says_so_in_one_line(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    for flags in (("--port", str(server.port)), ("--port", str(free_port()), "--metrics-port", str(server.port))):
        done = subprocess.run(
            [sys.executable, "-m", "shardq", "serve", "--data-dir", str(tmp_path / "other"), "--queue", "q", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "choose another --" in lines[0]
        assert "Traceback" not in done.stderr


def test_send_file_from_stdin_and_a_rerun_stores_nothing_twice(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    lines = "".join(json.dumps({"body": f"line {n}"}) + "\n" for n in range(250))
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "shardq", "send", "--queue", QUEUE, "--file", "-", "--json"],
            input=lines,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"SHARDQ_ENDPOINT": server.endpoint, "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"sent": 0, "duplicates": 250}
    assert stats(server)["visible"] == 250


def test_an_interrupted_send_says_what_was_acknowledged_and_a_rerun_completes_it(
    server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    total = 30_000
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps({"body": f"m{n}"}) + "\n" for n in range(total)))
    command = [sys.executable, "-m", "shardq", "send", "--queue", QUEUE, "--file", str(source)]
    environment = {"SHARDQ_ENDPOINT": server.endpoint, "PATH": "/usr/bin:/bin"}
    sending = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    deadline = time.monotonic() + 30
    while stats(server)["visible"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    sending.send_signal(signal.SIGINT)
    _, err = sending.communicate(timeout=60)
    assert sending.returncode == 130, err
    (summary,) = [line for line in err.splitlines() if line.startswith("interrupted:")]
    acknowledged = int(summary.split()[1])
    assert f"of {total} messages acknowledged" in summary
    assert 0 < acknowledged < total
    assert acknowledged <= stats(server)["visible"]

    again = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env=environment)
    assert again.returncode == 0, again.stderr
    assert stats(server)["visible"] == total


def test_receive_max_above_the_per_call_limit_pages(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps({"body": f"p{n}"}) + "\n" for n in range(1_500)))
    ok(server, "send", "--queue", QUEUE, "--file", str(source))
    received = ok(server, "receive", "--queue", QUEUE, "--max", "1200", "--visibility", "5m", "--json").splitlines()
    assert len(received) == 1_200
    assert len({json.loads(line)["id"] for line in received}) == 1_200
    assert stats(server) == {"visible": 300, "in_flight": 1_200, "delayed": 0}
