"""Invariant 5: a repeated dedup id returns the original id, stores nothing, and survives restarts."""

from __future__ import annotations

from shardq import Client, Message
from tests.support.servers import ServerProcess, drain, stored_count

QUEUE = "orders"


def test_duplicate_send_returns_original_id_and_stores_nothing(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        (original,) = client.send_messages(QUEUE, [Message(b"first", dedup_id="order-42")])
        assert original.ok
        assert not original.duplicate
        (repeat,) = client.send_messages(QUEUE, [Message(b"second", dedup_id="order-42")])
        assert repeat.duplicate
        assert repeat.message_id == original.message_id
        # In one batch, too, and next to a fresh message.
        results = client.send_messages(QUEUE, [Message(b"third", dedup_id="order-42"), Message(b"other")])
        assert [r.duplicate for r in results] == [True, False]
        assert results[0].message_id == original.message_id
        assert stored_count(client, QUEUE) == 2

    server.kill()
    server.restart()

    with Client(server.endpoint) as client:
        (after_restart,) = client.send_messages(QUEUE, [Message(b"fourth", dedup_id="order-42")])
        assert after_restart.duplicate
        assert after_restart.message_id == original.message_id
        assert stored_count(client, QUEUE) == 2
        bodies = {m.message_id: m.body for m in drain(client, QUEUE)}
        assert bodies[original.message_id] == b"first"
        assert sorted(bodies.values()) == [b"first", b"other"]


def test_a_dedup_id_outlives_its_message_deleted_or_purged_within_the_window(server: ServerProcess) -> None:
    """As in SQS, and as the README says: the window runs from the first send."""
    with Client(server.endpoint) as client:
        (deleted,) = client.send_messages(QUEUE, [Message(b"deleted", dedup_id="job-1")])
        (purged,) = client.send_messages(QUEUE, [Message(b"purged", dedup_id="job-2")])
        drained = drain(client, QUEUE)  # receives and deletes both
        assert sorted(m.body for m in drained) == [b"deleted", b"purged"]
        (kept,) = client.send_messages(QUEUE, [Message(b"kept", dedup_id="job-3")])
        client.purge(QUEUE)
        again = client.send_messages(
            QUEUE, [Message(b"again", dedup_id=dedup) for dedup in ("job-1", "job-2", "job-3")]
        )
        assert [(r.duplicate, r.message_id) for r in again] == [
            (True, deleted.message_id),
            (True, purged.message_id),
            (True, kept.message_id),
        ]
        assert stored_count(client, QUEUE) == 0
