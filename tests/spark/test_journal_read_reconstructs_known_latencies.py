"""The journal read, folded into lifecycles, gives back the timings of a
scripted workload: send, wait a known time, receive, wait, delete."""

from __future__ import annotations

import time

import pytest

from shardq import Client, Message, ReceivedMessage
from shardq.analytics.lifecycles import build_message_lifecycles
from tests.support.servers import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

# Seconds between send and delete, split evenly around the receive.
SCRIPTED_DELAYS = (0.2, 0.5, 0.9)
# Server timestamps are whole milliseconds; allow for rounding at both ends.
CLOCK_SLACK_MS = 2
POLL_DEADLINE_SECONDS = 20.0


def run_scripted_workload(endpoint: str) -> dict[str, tuple[float, float]]:
    """message id -> (scripted delay ms, observed upper bound ms)."""
    timings = {}
    with Client(endpoint) as client:
        for delay in SCRIPTED_DELAYS:
            started = time.time()
            [sent] = client.send_messages("orders", [Message(body=f"delay {delay}".encode())])
            time.sleep(delay / 2)  # the scripted wait before the consumer picks it up
            [received] = client.receive_messages("orders", max_messages=1, wait_time_ms=5000)
            assert received.message_id == sent.message_id
            time.sleep(delay / 2)  # the scripted processing time
            [deleted] = client.delete_messages("orders", [received.receipt])
            assert deleted.ok, deleted
            timings[sent.message_id] = (delay * 1000, (time.time() - started) * 1000)
    return timings


def test_latency_from_journal_is_at_least_the_scripted_delay_and_within_tolerance(start_server, read_queue) -> None:
    endpoint = start_server(["orders:shards=3"])
    timings = run_scripted_workload(endpoint)

    journal = read_queue(endpoint, "orders", "journal")
    assert journal.rdd.getNumPartitions() == 3
    events = journal.collect()
    kinds = sorted((row["message_id"], row["event_type"]) for row in events)
    assert kinds == sorted((mid, kind) for mid in timings for kind in ("SENT", "RECEIVED", "DELETED"))
    assert all(row["queue"] == "orders" and row["epoch"] >= 1 and row["log_index"] >= 1 for row in events)

    lifecycles = {row["message_id"]: row for row in build_message_lifecycles(journal).collect()}
    assert set(lifecycles) == set(timings)
    for message_id, (delay_ms, observed_ms) in timings.items():
        lifecycle = lifecycles[message_id]
        assert delay_ms <= lifecycle["latency_ms"] <= observed_ms + CLOCK_SLACK_MS, (delay_ms, lifecycle, observed_ms)
        wait_to_receive_ms = (lifecycle["first_received_at"] - lifecycle["sent_at"]).total_seconds() * 1000
        assert wait_to_receive_ms >= delay_ms / 2 - CLOCK_SLACK_MS
        assert lifecycle["outcome"] == "deleted"
        assert lifecycle["receive_count"] == 1
        assert lifecycle["first_received_at"] == lifecycle["last_received_at"]


def receive_soon(client: Client, queue: str) -> list[ReceivedMessage]:
    return wait_for(
        lambda: client.receive_messages(queue, max_messages=10, wait_time_ms=500),
        timeout=POLL_DEADLINE_SECONDS,
        what=f"a message in {queue!r}",
    )


def test_journal_records_redelivery_and_dead_lettering_with_reason(start_server, read_queue) -> None:
    endpoint = start_server(["work:shards=1,visibility=300ms,max_receive_count=2,dead_letter_queue=dlq", "dlq"])
    with Client(endpoint) as client:
        [sent] = client.send_messages("work", [Message(body=b"poison", group_id="")])
        first = receive_soon(client, "work")
        second = receive_soon(client, "work")  # after the 300 ms visibility timeout ran out
        assert [m.message_id for m in first + second] == [sent.message_id] * 2
        assert second[0].receive_count == 2

        # The next eligible delivery is over max_receive_count: a receive on `work`
        # moves the message to dlq instead of returning it.
        def arrived_in_dlq() -> list[ReceivedMessage]:
            assert client.receive_messages("work", max_messages=10, wait_time_ms=200) == []
            return client.receive_messages("dlq", max_messages=10, wait_time_ms=200)

        [dead] = wait_for(arrived_in_dlq, timeout=POLL_DEADLINE_SECONDS, what="the message in dlq")
    assert dead.body == b"poison"

    work = read_queue(endpoint, "work", "journal")
    types = [row["event_type"] for row in work.orderBy("log_index", "event_type").collect()]
    assert types.count("SENT") == 1
    assert types.count("RECEIVED") == 2
    assert "DEAD_LETTERED" in types
    assert "DEAD_LETTER_DELIVERED" in types

    [lifecycle] = build_message_lifecycles(work).collect()
    assert lifecycle["message_id"] == sent.message_id
    assert lifecycle["outcome"] == "dead_lettered"
    assert lifecycle["receive_count"] == 2
    assert lifecycle["dead_letter_reason"]
    assert lifecycle["first_received_at"] < lifecycle["last_received_at"]
    assert lifecycle["latency_ms"] is None

    [arrival] = read_queue(endpoint, "dlq", "journal").where("event_type = 'SENT'").collect()
    assert arrival["source_queue"] == "work"
    assert arrival["size"] == len(b"poison")
