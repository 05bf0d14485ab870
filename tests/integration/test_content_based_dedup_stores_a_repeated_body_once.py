"""Content-based dedup (SQS's ContentBasedDeduplication): on a queue that has it, a
message sent without a dedup id is deduplicated by its body's SHA-256, however it is
sent (unary, over the producer stream, the CLI) and whichever server or shard it
reaches first; a message's own dedup id still wins."""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.cli import run_shardq
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import ServerFactory, drain, stored_count, wait_for


def content_id(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def test_a_repeated_body_is_stored_once_however_it_is_sent(server_factory: ServerFactory) -> None:
    server = server_factory("texts:shards=4,content_based_dedup=true")
    with Client(server.endpoint) as client:
        (first,) = client.send_messages("texts", [Message(b"invoice 17", {"try": "1"})])
        assert first.ok
        assert not first.duplicate
        # Attributes, delay and batch neighbours are not part of the content: the body is.
        again = client.send_messages("texts", [Message(b"other"), Message(b"invoice 17", {"try": "2"}, delay_ms=1_000)])
        assert [(result.duplicate, result.message_id) for result in again[1:]] == [(True, first.message_id)]
        assert not again[0].duplicate
        streamed = client.send("texts", b"invoice 17")
        assert (streamed.duplicate, streamed.message_id) == (True, first.message_id)
        # A dedup id of the message's own wins over its content.
        (own_id,) = client.send_messages("texts", [Message(b"invoice 17", dedup_id="invoice-17-resent")])
        assert not own_id.duplicate
        assert stored_count(client, "texts") == 3

        sent_by_cli = run_shardq(server.endpoint, "send", "--queue", "texts", "--body", "other")
        assert sent_by_cli.returncode == 0, sent_by_cli.stderr
        assert sent_by_cli.stdout.split() == [again[0].message_id, "(duplicate)"]
        assert stored_count(client, "texts") == 3

        received = sorted((message.body, message.dedup_id) for message in drain(client, "texts"))
        assert received == [
            (b"invoice 17", "invoice-17-resent"),
            (b"invoice 17", content_id(b"invoice 17")),
            (b"other", content_id(b"other")),
        ]


def test_a_file_sent_to_such_a_queue_stores_each_body_once(
    server_factory: ServerFactory, tmp_path: pathlib.Path
) -> None:
    """`send --file` gives lines ids of their own only when asked to: the queue's
    content-based dedup makes a re-run safe already, and stores a body sent twice once."""
    server = server_factory("texts:content_based_dedup=true", "plain")
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"body": "a"}\n{"body": "b"}\n{"body": "a", "attributes": {"copy": "2"}}\n')
    for queue, options, printed in [
        ("texts", (), "sent 2, 1 duplicates"),
        ("texts", (), "sent 0, 3 duplicates"),  # a re-run
        ("plain", (), "sent 3, 0 duplicates"),  # line ids: the third line is not the first
        ("texts", ("--line-dedup",), "sent 3, 0 duplicates"),  # asked for: ids of the lines, new
    ]:
        result = run_shardq(server.endpoint, "send", "--queue", queue, "--file", str(lines), *options)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == printed, (queue, options)


def test_the_setting_changes_at_run_time_and_fifo_groups_dedup_by_content(server_factory: ServerFactory) -> None:
    server = server_factory("plain")
    with Client(server.endpoint) as client:
        created = client.create_queue("made", {"contentBasedDedup": "true", "shards": "3"})
        assert created["content_based_dedup"] is True
        assert [client.send("made", b"x").duplicate for _ in range(2)] == [False, True]
        changed = client.set_queue_attributes("made", {"ContentBasedDeduplication": "false"})
        assert changed["content_based_dedup"] is False
        assert client.send("made", b"x").duplicate is False  # stored again: no id, no dedup
        assert client.set_queue_attributes("made", {"contentBasedDedup": "true"})["content_based_dedup"] is True
        assert client.send("made", b"x").duplicate is True  # the first send's id is in the window still
        assert stored_count(client, "made") == 2

        client.create_queue("ordered", {"fifo": "true", "shards": "2", "contentBasedDedup": "true"})
        results = client.send_messages(
            "ordered", [Message(b"step", group_id="a"), Message(b"step", group_id="a"), Message(b"next", group_id="a")]
        )
        assert [result.duplicate for result in results] == [False, True, False]
        assert [m.body for m in drain(client, "ordered")] == [b"step", b"next"]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """Three shards, led by s1, s2 and s3."""
    spec = {"contentBasedDedup": True}
    yield from running(Cluster(tmp_path / "cluster", placement=THREE_LEADERS, spec=spec, lease_ms=60_000))


@pytest.mark.timeout(120)
def test_a_body_is_stored_once_in_a_cluster_whichever_server_and_shard_it_reaches(cluster: Cluster) -> None:
    bodies = [f"order {number}".encode() for number in range(30)]
    with grpc.insecure_channel(cluster.endpoint("s2")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
        # A client that routes: it gives the ids itself and sends each to its shard's leader.
        with Client(cluster.endpoint("s1")) as routing:
            first = routing.send_messages("orders", [Message(body) for body in bodies])
        assert not any(result.duplicate for result in first)
        assert len({result.shard for result in first}) == 3  # the bodies spread over every shard
        # A client whose map predates the setting pins each message to a shard of its
        # choice: the server routes by the content id instead, forwarding as needed.
        for shard in range(3):
            request = queue_pb2.SendMessagesRequest(
                queue="orders", shard=shard, messages=[queue_pb2.MessageToSend(body=body) for body in bodies]
            )
            response = stub.SendMessages(request, timeout=10)
            assert [(r.duplicate, r.message_id) for r in response.results] == [
                (True, result.message_id) for result in first
            ]
        # And one that goes through one endpoint, on the producer stream.
        with Client(cluster.endpoint("s3"), route_directly=False) as through_s3:
            assert all(through_s3.send("orders", body).duplicate for body in bodies[:5])
            assert stored_count(through_s3, "orders") == len(bodies)
