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
