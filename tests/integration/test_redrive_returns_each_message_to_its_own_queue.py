"""A redrive without a destination returns each dead letter to the queue it came from
(SQS's redrive to the source queues): the only right move for a DLQ several queues share,
where a redrive to one named queue would hand one queue's failures to another. Messages
that came from no queue sending its dead letters there stay, counted, and are visible
again at once. From Python and from the CLI; a DLQ nobody sends to, without a
destination, is INVALID_ARGUMENT naming `destination`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shardq import Client, Message
from shardq.errors import InvalidArgument, QueueNotFound
from tests.support.cli import run_shardq
from tests.support.servers import ServerProcess, drain, stored_count

DLQ = "orders-dlq"  # the server fixture's orders sends its dead letters here after 2 receives
SOURCE_ATTRIBUTE = "shardq.dead_letter.source_queue"


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint) as client:
        # A second queue sharing the DLQ, and one that has none.
        client.create_queue("payments", {"deadLetterQueue": DLQ, "maxReceiveCount": "1"})
        client.create_queue("audit")
        yield client


def dead_letter(client: Client, sent: dict[str, list[bytes]]) -> None:
    """Send `sent`'s bodies to their queues and receive them until all are in the DLQ."""
    for queue, bodies in sent.items():
        assert all(result.ok for result in client.send_messages(queue, [Message(body) for body in bodies]))
    total = sum(len(bodies) for bodies in sent.values())
    deadline = time.monotonic() + 30
    while client.attributes(DLQ).visible < total:
        assert time.monotonic() < deadline, f"only {client.attributes(DLQ).visible} of {total} dead-lettered"
        for queue in sent:
            client.receive_messages(queue, max_messages=10, visibility_timeout_ms=0)
        time.sleep(0.05)


def test_each_dead_letter_goes_back_to_its_own_queue_and_strays_stay(client: Client) -> None:
    dead_letter(client, {"orders": [b"order 1", b"order 2", b"order 3"], "payments": [b"payment 1", b"payment 2"]})
    assert client.send("orders-dlq", b"sent here directly").ok

    progress = list(client.redrive(source=DLQ))

    last = progress[-1]
    assert (last.done, last.moved, last.kept, last.remaining) == (True, 5, 1, 0)
    assert sorted(m.body for m in drain(client, "orders")) == [b"order 1", b"order 2", b"order 3"]
    assert sorted(m.body for m in drain(client, "payments")) == [b"payment 1", b"payment 2"]
    assert stored_count(client, "audit") == 0
    # The stray is visible again at once (its claim released), with nothing added.
    (stray,) = client.receive_messages(DLQ, max_messages=10, visibility_timeout_ms=0)
    assert (stray.body, SOURCE_ATTRIBUTE in stray.attributes) == (b"sent here directly", False)


def test_the_cli_redrives_to_the_source_queues_and_says_what_stayed(client: Client, server: ServerProcess) -> None:
    dead_letter(client, {"payments": [b"payment 1"]})
    assert client.send("orders-dlq", b"sent here directly").ok
    done = run_shardq(server.endpoint, "redrive", "--from", DLQ)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "moved 1"
    assert "warning: 1 message(s) of orders-dlq stayed there: they were not dead-lettered from a queue" in done.stderr
    assert [m.body for m in drain(client, "payments")] == [b"payment 1"]


def test_a_named_destination_still_takes_everything(client: Client) -> None:
    dead_letter(client, {"orders": [b"order"], "payments": [b"payment"]})
    last = list(client.redrive(source=DLQ, destination="audit"))[-1]
    assert (last.done, last.moved, last.kept) == (True, 2, 0)
    assert sorted(m.body for m in drain(client, "audit")) == [b"order", b"payment"]


def test_without_a_destination_a_queue_nobody_sends_to_or_a_missing_one_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument) as refused:
        list(client.redrive(source="audit"))
    assert refused.value.field == "destination"
    assert "no queue sends its dead letters to 'audit'" in str(refused.value)
    with pytest.raises(QueueNotFound):
        list(client.redrive(source="no-such-dlq"))
