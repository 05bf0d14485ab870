"""A receive is answered once its claims are decided, before its batch commits, so its
batch has no answer for the commit-ahead file to hasten: a standalone server commits it
to LMDB without writing it ahead (its commit syncs LMDB's meta page itself), and the
requests queued behind it wait for LMDB's commit alone (its meta page's sync in place
of the record's write; measured, the writer is held less). Sends and deletes
are still answered from the commit-ahead file, and a restart on a data file that lacks
the two batches after a receive applies them from that file: the records around a batch
not written ahead still chain.

The crash's on-disk state is made for real, as in
test_a_restart_applies_batches_answered_ahead_of_lmdb: the shard's data file copied once
the receive's commit returned, and put back after a SIGKILL.
"""

from __future__ import annotations

import pathlib
import shutil

from shardq import Client, Message
from tests.integration.scraping import samples, scrape_text, values
from tests.support.servers import ServerProcess, drain, wait_for

QUEUE = "orders"


def commits(server: ServerProcess) -> tuple[float, float]:
    """The shard's commits LMDB has made, and how many of them were written ahead."""
    found = samples(scrape_text(server.metrics_url))
    made = sum(values(found, "shardq_commits_total", queue=QUEUE, shard="0"))
    ahead = sum(values(found, "shardq_commits_written_ahead_total", queue=QUEUE, shard="0"))
    return made, ahead


def settled_at(server: ServerProcess, made: float) -> tuple[float, float]:
    """The counts once LMDB has made `made` commits (answers come before LMDB's commit)."""
    return wait_for(
        lambda: counts if (counts := commits(server))[0] >= made else None,
        timeout=10,
        what=f"{made:g} commits made",
    )


def test_a_receive_is_not_written_ahead_and_a_restart_still_applies_what_came_after_it(
    tmp_path: pathlib.Path,
) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=1"])
    server.start()
    shard = server.data_dir / "queues" / QUEUE / "shard-0"
    after_the_receive = tmp_path / "data-after-the-receive.mdb"
    try:
        with Client(server.endpoint) as client:
            made, ahead = commits(server)
            assert client.send_messages(QUEUE, [Message(b"kept")])[0].ok
            assert client.send_messages(QUEUE, [Message(b"deleted")])[0].ok
            # One call at a time, nothing waiting for the writer: each send written ahead.
            assert settled_at(server, made + 2) == (made + 2, ahead + 2)

            received = {
                m.body: m for m in client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
            }
            assert sorted(received) == [b"deleted", b"kept"]
            # Its one commit was made without the write ahead.
            assert settled_at(server, made + 3) == (made + 3, ahead + 2)
            shutil.copyfile(shard / "data.mdb", after_the_receive)

            assert client.delete_messages(QUEUE, [received[b"deleted"].receipt])[0].ok
            assert client.send_messages(QUEUE, [Message(b"sent last")])[0].ok
            assert settled_at(server, made + 5) == (made + 5, ahead + 4)
        # A machine crash right after those two answers: LMDB lacks both batches.
        server.kill()
        shutil.copyfile(after_the_receive, shard / "data.mdb")
        server.start()
        assert "from the commit-ahead file" in server.log()
        with Client(server.endpoint) as client:
            # "deleted" is gone and "kept" still claimed by the receive (for 60 s).
            assert [m.body for m in drain(client, QUEUE)] == [b"sent last"]
            attributes = client.attributes(QUEUE)
            assert (attributes.visible, attributes.in_flight) == (0, 1)
    finally:
        server.cleanup()
