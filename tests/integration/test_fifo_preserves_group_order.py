"""Invariant 6: FIFO groups deliver in send order, one in flight per group, groups in parallel."""

from __future__ import annotations

import pytest

from shardq import Client, InvalidArgument, Message
from tests.support.servers import stored_count

QUEUE = "fifo"
GROUPS = ("alpha", "beta", "gamma", "delta")
PER_GROUP = 5


def test_groups_in_order_one_in_flight_each(client: Client) -> None:
    for i in range(PER_GROUP):
        client.send_messages(QUEUE, [Message(f"{g}-{i}".encode(), group_id=g) for g in GROUPS])
    delivered: dict[str, list[str]] = {g: [] for g in GROUPS}
    for step in range(PER_GROUP):
        batch = client.receive_messages(QUEUE, max_messages=100, visibility_timeout_ms=60_000)
        # Every group proceeds, each with exactly its next message.
        assert sorted(m.group_id for m in batch) == sorted(GROUPS), step
        for message in batch:
            assert message.body == f"{message.group_id}-{step}".encode()
            delivered[message.group_id].append(message.body.decode())
        # While one member of each group is in flight, nothing else is delivered.
        assert client.receive_messages(QUEUE, max_messages=100) == []
        results = client.delete_messages(QUEUE, [m.receipt for m in batch])
        assert all(r.ok for r in results)
    assert delivered == {g: [f"{g}-{i}" for i in range(PER_GROUP)] for g in GROUPS}
    assert stored_count(client, QUEUE) == 0


def test_expired_head_is_redelivered_before_its_successors(client: Client) -> None:
    client.send_messages(QUEUE, [Message(b"one", group_id="g"), Message(b"two", group_id="g")])
    (first,) = client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=200)
    assert first.body == b"one"
    (again,) = client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000, wait_time_ms=5_000)
    assert again.body == b"one"
    assert again.receive_count == 2


def test_fifo_send_without_group_is_invalid(client: Client) -> None:
    with pytest.raises(InvalidArgument) as raised:
        client.send_messages(QUEUE, [Message(b"no group")])
    assert raised.value.field == "messages[0].group_id"
    with pytest.raises(InvalidArgument) as raised:
        client.send_messages(QUEUE, [Message(b"ok", group_id="g"), Message(b"no group")])
    assert raised.value.field == "messages[1].group_id"
    assert stored_count(client, QUEUE) == 0
