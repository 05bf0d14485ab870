"""Backpressure: a queue at max depth answers QUEUE_FULL with a retry delay and drops nothing."""

from __future__ import annotations

import pytest

from shardq import Client, Message, QueueFull
from tests.integration.harness import ServerFactory, drain, stored_count

QUEUE = "bounded"


def test_full_queue_answers_queue_full_and_keeps_what_it_stored(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:max_depth=10")
    with Client(server.endpoint) as client:
        sent = [client.send_messages(QUEUE, [Message(b"%d" % i)])[0] for i in range(10)]
        assert all(r.ok for r in sent)
        for attempt in ([Message(b"one more")], [Message(b"a"), Message(b"b"), Message(b"c")]):
            with pytest.raises(QueueFull) as raised:
                client.send_messages(QUEUE, attempt)
            assert raised.value.retry_after_ms > 0
        with pytest.raises(QueueFull):
            client.send(QUEUE, b"streamed one more")
        assert stored_count(client, QUEUE) == 10
        drained = drain(client, QUEUE)
        assert sorted(m.message_id for m in drained) == sorted(r.message_id for r in sent)
        assert sorted(m.body for m in drained) == sorted(b"%d" % i for i in range(10))
        # Room again once consumers made it.
        (after,) = client.send_messages(QUEUE, [Message(b"fits now")])
        assert after.ok


def test_partially_full_batch_is_refused_whole(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:max_depth=10")
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"%d" % i) for i in range(8)])
        with pytest.raises(QueueFull):
            client.send_messages(QUEUE, [Message(b"x%d" % i) for i in range(3)])
        assert stored_count(client, QUEUE) == 8
