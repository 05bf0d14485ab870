"""A standalone server answers a batch once its entry is in the commit-ahead file, before
LMDB's commit is durable; restarted on a data file that lacks its last two batches (what
a machine crash can leave: LMDB's meta page of a commit becomes durable only with the
next commit), it applies them from that file before serving, and says so. With
--no-commit-ahead the server keeps no such file: every answer waits for LMDB's commit.

The crash's on-disk state is made for real: the shard's data file copied from the
running server, idle, before the two batches, and put back after a SIGKILL. A SIGKILL
alone cannot be timed to land between the answer and LMDB's commit; the tests that kill
servers under load (test_acknowledged_sends_survive_sigkill) land there by chance.
"""

from __future__ import annotations

import pathlib
import shutil

from shardq import Client, Message
from tests.integration.scraping import samples, scrape_text, values
from tests.support.servers import ServerProcess, drain, wait_for

QUEUE = "orders"


def shard_directory(server: ServerProcess) -> pathlib.Path:
    return server.data_dir / "queues" / QUEUE / "shard-0"


def lmdb_commits(server: ServerProcess) -> float:
    """The shard's commits LMDB has made (counted once each commit returns)."""
    return sum(values(samples(scrape_text(server.metrics_url)), "shardq_commits_total", queue=QUEUE, shard="0"))


def test_a_restart_applies_the_batches_lmdb_lacks_from_the_commit_ahead_file(tmp_path: pathlib.Path) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=1"])
    server.start()
    before = tmp_path / "data-before-the-last-two-batches.mdb"
    try:
        with Client(server.endpoint) as client:
            assert client.send_messages(QUEUE, [Message(b"first")])[0].ok
            # Answered before LMDB's commit: the copy is taken once LMDB has made it (a
            # crash leaves LMDB at most two batches short, never three).
            wait_for(lambda: lmdb_commits(server) >= 1 or None, timeout=10, what="the first batch's LMDB commit")
            shutil.copyfile(shard_directory(server) / "data.mdb", before)
            assert client.send_messages(QUEUE, [Message(b"second")])[0].ok
            assert all(result.ok for result in client.send_messages(QUEUE, [Message(b"third"), Message(b"fourth")]))
        server.kill()
        shutil.copyfile(before, shard_directory(server) / "data.mdb")
        server.start()
        assert "from the commit-ahead file" in server.log()
        with Client(server.endpoint) as client:
            received = sorted(message.body for message in drain(client, QUEUE))
        assert received == [b"first", b"fourth", b"second", b"third"]
    finally:
        server.cleanup()


def test_without_commit_ahead_the_server_keeps_no_commit_ahead_file(tmp_path: pathlib.Path) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=1"], "--no-commit-ahead")
    server.start()
    try:
        with Client(server.endpoint) as client:
            assert client.send_messages(QUEUE, [Message(b"only")])[0].ok
            assert [message.body for message in drain(client, QUEUE)] == [b"only"]
        assert (shard_directory(server) / "data.mdb").exists()
        assert not (shard_directory(server) / "commit-ahead").exists()
    finally:
        server.cleanup()
