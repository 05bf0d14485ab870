"""Backpressure: a queue at max depth answers QUEUE_FULL with a retry delay and drops nothing."""

from __future__ import annotations

import pytest

from shardq import Client, InvalidArgument, Message, QueueFull
from tests.support.servers import ServerFactory, drain, stored_count

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


def test_max_depth_bounds_the_queue_not_each_shard(server_factory: ServerFactory) -> None:
    """A 2-shard queue filled unevenly, then drained below its limit, takes sends on any shard."""
    server = server_factory(f"{QUEUE}:max_depth=20,shards=2")
    with Client(server.endpoint) as client:
        filled = 0
        while filled < 20:
            filled += len(client.send_messages(QUEUE, [Message(b"f%d" % filled)]))
        with pytest.raises(QueueFull):
            client.send_messages(QUEUE, [Message(b"over")])
        per_shard = {shard.shard: shard.visible for shard in client.attributes(QUEUE).shards}
        fuller = max(per_shard, key=lambda shard: per_shard[shard])
        # Drain five messages from the emptier shard only: the fuller one keeps all it had.
        emptier = 1 - fuller
        taken = 0
        while taken < 5:
            for message in client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000):
                if message.shard == emptier and taken < 5:
                    client.delete_messages(QUEUE, [message.receipt])
                    taken += 1
                else:
                    client.release_messages(QUEUE, [message.receipt])
        assert stored_count(client, QUEUE) == 15
        # Now every send fits, whichever shard it lands on (round robin reaches both).
        accepted = [client.send_messages(QUEUE, [Message(b"room %d" % n)])[0] for n in range(5)]
        assert all(result.ok for result in accepted)
        assert stored_count(client, QUEUE) == 20


def test_a_batch_larger_than_max_depth_is_refused_as_never_fitting(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:max_depth=3")
    with Client(server.endpoint) as client:
        with pytest.raises(InvalidArgument) as refused:
            client.send_messages(QUEUE, [Message(b"%d" % n) for n in range(4)])
        assert refused.value.field == "messages"
        assert "can never fit" in str(refused.value)
        assert refused.value.retry_after_ms == 0
        assert stored_count(client, QUEUE) == 0
