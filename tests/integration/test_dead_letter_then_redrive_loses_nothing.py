"""Invariant 4 and redrive: dead-lettering never drops a message; redrive brings it back, rate-limited."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from shardq import Client, Message
from shardq.errors import InvalidArgument
from tests.support.servers import ServerFactory, ServerProcess, drain, stored_count, wait_for

SOURCE = "orders"  # max_receive_count=2
DLQ = "orders-dlq"


def test_message_received_too_often_moves_to_dlq_and_redrives_back(client: Client) -> None:
    (sent,) = client.send_messages(SOURCE, [Message(b"poison", attributes={"kind": "poison"})])
    for expected_count in (1, 2):
        (received,) = client.receive_messages(SOURCE, max_messages=1, visibility_timeout_ms=200, wait_time_ms=5_000)
        assert received.message_id == sent.message_id
        assert received.receive_count == expected_count
    # The third eligible delivery dead-letters it instead of handing it out.
    assert client.receive_messages(SOURCE, max_messages=1, visibility_timeout_ms=200, wait_time_ms=1_000) == []

    def dead_lettered() -> bool:
        return stored_count(client, SOURCE) == 0 and client.attributes(DLQ).visible == 1

    wait_for(dead_lettered, timeout=10, what="the message to reach the dead-letter queue")
    (in_dlq,) = client.receive_messages(DLQ, max_messages=10, visibility_timeout_ms=0)
    # The copy keeps the attributes and says where it came from and why.
    assert (in_dlq.body, in_dlq.attributes) == (
        b"poison",
        {
            "kind": "poison",
            "shardq.dead_letter.source_queue": SOURCE,
            "shardq.dead_letter.reason": "received 2 times (max_receive_count 2)",
        },
    )
    assert in_dlq.receive_count == 1

    progress = list(client.redrive(source=DLQ, destination=SOURCE))
    assert progress[-1].done
    assert progress[-1].moved == 1
    assert stored_count(client, DLQ) == 0
    (back,) = drain(client, SOURCE)
    assert (back.body, back.attributes, back.receive_count) == (b"poison", {"kind": "poison"}, 1)


def test_cli_redrive_respects_its_rate_limit(server: ServerProcess, client: Client) -> None:
    count, rate = 20, 10
    client.send_messages(DLQ, [Message(b"%d" % i) for i in range(count)])
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardq",
            "redrive",
            "--endpoint",
            server.endpoint,
            "--from",
            DLQ,
            "--to",
            SOURCE,
            "--rate",
            f"{rate}/s",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"moved {count}"
    # 20 messages at 10/s cannot finish in much under 2 s (loose: the limiter's bound, not a benchmark).
    assert elapsed >= 1.5, f"redrive of {count} at {rate}/s took only {elapsed:.2f}s"
    assert stored_count(client, DLQ) == 0
    assert sorted(m.body for m in drain(client, SOURCE)) == sorted(b"%d" % i for i in range(count))


def test_redrive_at_a_rate_moves_messages_smoothly(server: ServerProcess, client: Client) -> None:
    count, rate = 20, 10
    client.send_messages(DLQ, [Message(b"%d" % i) for i in range(count)])
    progress = list(client.redrive(source=DLQ, destination=SOURCE, rate_per_second=rate))
    assert progress[-1].moved == count
    moved_at = sorted(m.sent_at_ms for m in drain(client, SOURCE))
    assert len(moved_at) == count
    # Never more than a second's worth (plus one batch) within any one second: no bursts.
    for first in range(count):
        within_a_second = sum(1 for at in moved_at[first:] if at - moved_at[first] < 1_000)
        assert within_a_second <= rate + 1, f"{within_a_second} moved within 1 s of message {first}: {moved_at}"


def test_redrive_errors_name_the_queue_that_is_missing(server: ServerProcess) -> None:
    for source, destination, missing in ((DLQ, "nope", "nope"), ("gone", SOURCE, "gone")):
        done = subprocess.run(
            [sys.executable, "-m", "shardq", "redrive", "--endpoint", server.endpoint, "--from", source,
             "--to", destination],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
        assert done.returncode == 1
        assert f"queue '{missing}' does not exist" in done.stderr, done.stderr


def test_dead_letters_refused_by_a_full_dlq_move_once_it_has_room(server_factory: ServerFactory) -> None:
    """The mover survives a refusal: when the DLQ refused every copy (full), the pending
    dead letters used to stay pending forever, the background task having died."""
    server = server_factory("work:dead_letter_queue=small-dlq,max_receive_count=1", "small-dlq:max_depth=1")
    with Client(server.endpoint) as client:
        client.send_messages("work", [Message(b"poison %d" % n) for n in range(3)])
        for _ in range(2):  # the second receive is past max_receive_count: dead-lettered
            for message in client.receive_messages("work", max_messages=10, visibility_timeout_ms=60_000):
                client.change_visibility("work", [(message.receipt, 0)])

        def dlq_full() -> bool:
            return client.attributes("small-dlq").visible == 1

        wait_for(dlq_full, timeout=15, what="the first dead letter in the DLQ")
        time.sleep(2)  # rounds in which the full DLQ refuses the other two
        moved: list[bytes] = []

        def all_moved() -> bool:
            for message in client.receive_messages("small-dlq", max_messages=10, visibility_timeout_ms=60_000):
                moved.append(message.body)
                client.delete_messages("small-dlq", [message.receipt])
            return len(moved) == 3

        wait_for(all_moved, timeout=30, what="every dead letter to reach the DLQ once it had room")
        assert sorted(moved) == [b"poison 0", b"poison 1", b"poison 2"]
        assert client.attributes("work").dead_letter_pending == 0


@pytest.mark.parametrize("rate", [math.nan, math.inf, -1.0])
def test_a_redrive_rate_that_is_not_a_finite_number_is_refused_by_name(server: ServerProcess, rate: float) -> None:
    """NaN and infinity once failed inside the server as UNKNOWN, with no reason."""
    with Client(server.endpoint) as client:
        client.send_messages(DLQ, [Message(b"dead")])
        with pytest.raises(InvalidArgument) as raised:
            list(client.redrive(source=DLQ, destination=SOURCE, rate_per_second=rate))
        assert raised.value.field == "rate_per_second"
        assert "finite number >= 0" in raised.value.message
        assert stored_count(client, DLQ) == 1
        assert stored_count(client, SOURCE) == 0
