"""Priority lanes (design §3's "priority lanes", RabbitMQ's priority queues): on a queue
with `priorityLanes`, a shard delivers its eligible messages highest lane first, oldest
first within a lane; the lanes survive a crash, show in peeks and receives, and go
with a message to its dead-letter queue and back."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest

from shardq import Client, Message, ReceivedMessage
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.fencing import build_takeover, is_expired, isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.errors import ShardqError
from tests.support.cli import run_shardq
from tests.support.clusters import LEASE_MS, Cluster, running, send_until_accepted
from tests.support.servers import ServerFactory, drain, wait_for
from tests.support.status_details import error_info


def bodies(messages: Sequence[ReceivedMessage]) -> list[bytes]:
    return [message.body for message in messages]


def test_a_shard_delivers_higher_lanes_first_and_keeps_them_through_a_crash(server_factory: ServerFactory) -> None:
    server = server_factory("jobs:priority_lanes=3")
    with Client(server.endpoint) as client:
        client.send_messages("jobs", [Message(b"low 1"), Message(b"low 2"), Message(b"low 3")])
        client.send_messages("jobs", [Message(b"mid 1", priority=1), Message(b"high 1", priority=2)])
        assert not client.send("jobs", b"high 2", priority=2).duplicate
        client.send_messages(
            "jobs", [Message(b"mid 2", priority=1), Message(b"late high", priority=2, delay_ms=60_000)]
        )
        assert bodies(client.peek_messages("jobs", max_messages=3)) == [b"high 1", b"high 2", b"mid 1"]

    server.kill()
    server.restart()

    with Client(server.endpoint) as client:
        first = client.receive_messages("jobs", max_messages=3, visibility_timeout_ms=1_000)
        assert [(m.body, m.priority) for m in first] == [(b"high 1", 2), (b"high 2", 2), (b"mid 1", 1)]
        second = client.receive_messages("jobs", max_messages=2, visibility_timeout_ms=60_000)
        assert [(m.body, m.priority) for m in second] == [(b"mid 2", 1), (b"low 1", 0)]
        # The first three were not deleted: once their claims expire they come before the lows again.
        time.sleep(1.2)
        assert bodies(drain(client, "jobs")) == [b"high 1", b"high 2", b"mid 1", b"low 2", b"low 3"]


def test_a_priority_the_queue_has_no_lane_for_is_refused_naming_the_field(server_factory: ServerFactory) -> None:
    server = server_factory("jobs:priority_lanes=3", "plain")
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        for queue, problem in [
            ("jobs", "must be 0..2 (queue 'jobs' has 3 priority lanes), got 3"),
            ("plain", "queue 'plain' has no priority lanes (priorityLanes 1): give 0, got 3"),
        ]:
            request = queue_pb2.SendMessagesRequest(
                queue=queue,
                messages=[queue_pb2.MessageToSend(body=b"ok"), queue_pb2.MessageToSend(body=b"x", priority=3)],
            )
            with pytest.raises(grpc.RpcError) as raised:
                stub.SendMessages(request, timeout=5)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(raised.value).metadata["field"] == "messages[1].priority"
            assert problem in str(raised.value.details())
    with Client(server.endpoint) as client:
        assert client.attributes("jobs").visible == 0  # the valid neighbour was not stored either
        with pytest.raises(Exception, match="cannot be sent as given"):
            client.send_messages("jobs", [Message(b"x", priority=-1)])
        with pytest.raises(Exception, match="FIFO queue has no priority lanes"):
            client.create_queue("ordered", {"fifo": "true", "priorityLanes": "2"})


def test_the_cli_sends_with_a_priority_and_shows_it(server_factory: ServerFactory, tmp_path: pathlib.Path) -> None:
    server = server_factory("jobs:priority_lanes=10")
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"body": "later"}\n{"body": "sooner", "priority": 5}\n')
    sent_file = run_shardq(server.endpoint, "send", "--queue", "jobs", "--file", str(lines))
    assert sent_file.returncode == 0, sent_file.stderr
    lines.write_text('{"body": "x", "priority": "high"}\n')
    bad_line = run_shardq(server.endpoint, "send", "--queue", "jobs", "--file", str(lines))
    assert bad_line.returncode != 0
    assert "line 1: priority must be a whole number from 0, got 'high'" in bad_line.stderr
    sent = run_shardq(server.endpoint, "send", "--queue", "jobs", "--body", "now", "--priority", "9")
    assert sent.returncode == 0, sent.stderr
    received = run_shardq(server.endpoint, "receive", "--queue", "jobs", "--max", "3", "--json")
    assert received.returncode == 0, received.stderr
    shown = [json.loads(line) for line in received.stdout.splitlines()]
    assert [(line["body"], line["priority"]) for line in shown] == [("now", 9), ("sooner", 5), ("later", 0)]
    refused = run_shardq(server.endpoint, "send", "--queue", "jobs", "--body", "x", "--priority", "10")
    assert refused.returncode != 0
    assert "priority" in refused.stderr
    assert "must be 0..9" in refused.stderr


def test_a_dead_letter_keeps_its_lane_through_a_dlq_without_lanes_and_back(server_factory: ServerFactory) -> None:
    server = server_factory("jobs:priority_lanes=3,dlq=jobs-dlq,max_receive_count=5", "jobs-dlq")
    with Client(server.endpoint) as client:
        client.send_messages("jobs", [Message(b"urgent", priority=2)])
        (message,) = client.receive_messages("jobs", max_messages=1)
        assert client.release_messages("jobs", [message.receipt], reason="broken", dead_letter=True)[0].ok
        deadline = time.monotonic() + 10
        while not (dead := client.peek_messages("jobs-dlq")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(m.body, m.priority) for m in dead] == [(b"urgent", 0)]  # the DLQ has one lane
        assert dead[0].attributes["shardq.dead_letter.priority"] == "2"

        client.send_messages("jobs", [Message(b"routine")])
        progress = list(client.redrive(source="jobs-dlq"))
        assert progress[-1].moved == 1
        back = client.receive_messages("jobs", max_messages=2)
        assert [(m.body, m.priority) for m in back] == [(b"urgent", 2), (b"routine", 0)]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """One shard with two replicas, led by s1."""
    yield from running(
        Cluster(tmp_path / "cluster", placement=[["s1", "s2"]], spec={"priorityLanes": 3}, lease_ms=LEASE_MS)
    )


@pytest.mark.timeout(120)
def test_a_follower_that_takes_over_delivers_by_lane_too(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s2")) as client:
        send_until_accepted(client, [b"low 1", b"low 2"], shard_hint="startup")
        client.send_messages("orders", [Message(b"high", priority=2), Message(b"mid", priority=1)])
        cluster.kill("s1")

        def expired_lease() -> LeaseRecord | None:
            lease = cluster.leader_of(0)
            return lease if is_expired(lease, int(time.time() * 1000)) else None

        expired = wait_for(expired_lease, timeout=20, what="the dead leader's lease to expire")
        assert "s2" in isr_of(expired)
        cluster.leases.update(
            build_takeover(expired, new_holder="s2", now_ms=int(time.time() * 1000), duration_ms=cluster.lease_ms)
        )

        def received() -> list[tuple[bytes, int]] | None:
            try:
                messages = client.receive_messages("orders", max_messages=4, visibility_timeout_ms=60_000)
            except ShardqError:
                return None  # s2 is taking the lease up
            return [(m.body, m.priority) for m in messages] or None

        taken = wait_for(received, timeout=30, interval=0.2, what="s2 to lead")
        assert taken == [(b"high", 2), (b"mid", 1), (b"low 1", 0), (b"low 2", 0)]
