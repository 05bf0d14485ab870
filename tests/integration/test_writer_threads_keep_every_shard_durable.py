"""Shards sharing several writer threads (LMDB calls then release the GIL) still
lose no acknowledged send across a SIGKILL, and a bad thread count is refused."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from shardq import Client, Message
from tests.support.servers import ServerProcess, drain

QUEUE = "spread"
MESSAGES = 400


def test_acknowledged_sends_survive_sigkill_with_two_writer_threads(tmp_path: pathlib.Path) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=4"], "--writer-threads", "2")
    server.start()
    try:
        with Client(server.endpoint) as client:
            acknowledged: set[bytes] = set()
            shards: set[int] = set()
            for start in range(0, MESSAGES, 40):
                # Keyed messages spread over all four shards, so both threads commit.
                batch = [Message(b"m%d" % n, dedup_id=f"k{n}") for n in range(start, start + 40)]
                results = client.send_messages(QUEUE, batch)
                assert all(result.ok for result in results)
                acknowledged.update(message.body for message in batch)
                shards.update(result.shard for result in results)
            assert shards == {0, 1, 2, 3}
        server.kill()
        server.start()
        with Client(server.endpoint) as client:
            bodies = [message.body for message in drain(client, QUEUE)]
        assert sorted(bodies) == sorted(acknowledged)
        assert len(bodies) == MESSAGES
    finally:
        server.cleanup()


def test_zero_writer_threads_is_refused(tmp_path: pathlib.Path) -> None:
    command = [sys.executable, "-m", "shardq", "serve", "--data-dir", str(tmp_path), "--queue", QUEUE]
    finished = subprocess.run(
        [*command, "--writer-threads", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finished.returncode != 0
    assert "--writer-threads" in finished.stderr
