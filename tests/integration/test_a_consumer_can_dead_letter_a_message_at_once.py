"""A consumer that knows a message will never succeed sends it to the dead-letter queue at
once, on its first receive, instead of retrying it until max_receive_count (SQS cannot;
RabbitMQ's reject without requeue does): over a unary release, over the consumer stream,
from a run_consumer handler raising DeadLetter, and with `shardq release --dead-letter`.
The copy says it was rejected and why; a queue without a dead-letter queue refuses,
naming `dead_letter`, and keeps the message; on a cluster the leader of the message's
shard does it, whichever server is called."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from shardq import AsyncClient, Client, DeadLetter, InvalidArgument, Message, run_consumer
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.consumer import ConsumerStats
from shardq.coordination.cluster_map import QueueEntry
from shardq.types import ReceivedMessage
from tests.support.cli import run_shardq
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import ServerFactory, drain, stored_count, wait_for
from tests.support.status_details import error_info

# Five receives before the mover would take it: a dead letter after one was rejected.
QUEUES = ("jobs:dead_letter_queue=jobs-dlq,max_receive_count=5", "jobs-dlq", "plain")
SOURCE = "shardq.dead_letter.source_queue"
WHY = "shardq.dead_letter.reason"
LAST_ERROR = "shardq.dead_letter.last_error"


def dead_letters(client: Client, count: int, dlq: str = "jobs-dlq") -> list[ReceivedMessage]:
    wait_for(lambda: client.attributes(dlq).visible == count, timeout=30, what=f"{count} dead letter(s) in {dlq}")
    return drain(client, dlq)


def test_a_unary_release_dead_letters_on_the_first_receive(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)
    with Client(server.endpoint) as client:
        client.send_messages("jobs", [Message(b"unparseable", {"customer": "17"}), Message(b"fine")])
        received = client.receive_messages("jobs", max_messages=10, visibility_timeout_ms=60_000)
        poison = next(m for m in received if m.body == b"unparseable")
        (result,) = client.release_messages("jobs", [poison.receipt], reason="no customer id", dead_letter=True)
        assert result.ok
        (copy,) = dead_letters(client, 1)
        assert (copy.body, copy.attributes["customer"], copy.attributes[SOURCE]) == (b"unparseable", "17", "jobs")
        assert copy.attributes[WHY] == "rejected by its consumer on receive 1 (max_receive_count 5)"
        assert copy.attributes[LAST_ERROR] == "no customer id"
        # Gone from jobs; the other message is untouched, still claimed by its receive.
        assert stored_count(client, "jobs") == 1
        # Its receipt is spent: a second try is a stale receipt, not a second copy.
        (again,) = client.release_messages("jobs", [poison.receipt], dead_letter=True)
        assert (again.ok, again.reason) == (False, "MESSAGE_NOT_FOUND")


def test_a_queue_without_a_dead_letter_queue_refuses_and_keeps_the_message(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)
    with Client(server.endpoint) as client:
        client.send_messages("plain", [Message(b"kept")])
        (message,) = client.receive_messages("plain", max_messages=1, visibility_timeout_ms=60_000)
        with pytest.raises(InvalidArgument) as refused:
            client.release_messages("plain", [message.receipt], dead_letter=True)
        assert refused.value.field == "dead_letter"
        assert "queue 'plain' has no dead-letter queue" in str(refused.value)
        assert client.attributes("plain").in_flight == 1  # still claimed, nothing dropped
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        request = queue_pb2.ReleaseMessagesRequest(queue="plain", receipts=[message.receipt], dead_letter=True)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ReleaseMessages(request, timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(raised.value).metadata["field"] == "dead_letter"


def test_the_consumer_stream_dead_letters_and_refuses_whole_without_a_dlq(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)

    async def scenario() -> None:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages("jobs", [Message(b"poison")])
            await client.send_messages("plain", [Message(b"kept")])
            async with client.consume("jobs", credits=1) as stream:
                message = await anext(stream.messages())
                (result,) = await stream.dead_letter([message.receipt], reason="schema v1, we read v2")
                assert result.ok
            async with client.consume("plain", credits=1) as stream:
                message = await anext(stream.messages())
                with pytest.raises(InvalidArgument) as refused:
                    await stream.dead_letter([message.receipt])
                assert refused.value.field == "ack.dead_letter"
                # Refused whole, before anything was acted on: the claim still holds.
                assert (await stream.delete([message.receipt]))[0].ok

    asyncio.run(scenario())
    with Client(server.endpoint) as client:
        (copy,) = dead_letters(client, 1)
        assert (copy.body, copy.attributes[LAST_ERROR]) == (b"poison", "schema v1, we read v2")
        assert stored_count(client, "plain") == 0


def test_a_run_consumer_handler_raising_dead_letter_sends_it_there_at_once(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)
    handled: list[bytes] = []

    def handler(message: ReceivedMessage) -> None:
        if message.body.startswith(b"bad"):
            raise DeadLetter(f"cannot parse {message.body.decode()}")
        handled.append(message.body)

    async def scenario() -> tuple[int, int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages("jobs", [Message(b"good 1"), Message(b"bad 1"), Message(b"good 2")])
            stats = await asyncio.wait_for(
                run_consumer(client, "jobs", handler, concurrency=2, handle_signals=False, max_messages=3), 60
            )
            return stats.handled, stats.dead_lettered, stats.failed

    assert asyncio.run(scenario()) == (2, 1, 0)
    assert sorted(handled) == [b"good 1", b"good 2"]
    with Client(server.endpoint) as client:
        (copy,) = dead_letters(client, 1)
        assert copy.attributes[LAST_ERROR] == "DeadLetter: cannot parse bad 1"
        assert copy.attributes[WHY].startswith("rejected by its consumer on receive 1")


def test_on_a_queue_without_one_a_dead_letter_handler_is_a_release(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)

    def handler(message: ReceivedMessage) -> None:
        raise DeadLetter("no good")

    async def scenario() -> tuple[int, int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages("plain", [Message(b"kept")])
            stop, stats = asyncio.Event(), ConsumerStats()
            consumer = asyncio.create_task(
                run_consumer(client, "plain", handler, concurrency=1, handle_signals=False, stop=stop, stats=stats)
            )
            for _ in range(200):
                if stats.failed or consumer.done():
                    break
                await asyncio.sleep(0.05)
            stop.set()
            await consumer
            return stats.handled, stats.dead_lettered, stats.failed

    handled, dead, failed = asyncio.run(scenario())
    assert (handled, dead) == (0, 0)
    assert failed >= 1
    with Client(server.endpoint) as client:
        assert stored_count(client, "plain") == 1  # released with backoff, never dropped


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """orders led by s1 (with a follower on s2), its DLQ led by s2: s3 holds no copy of orders."""
    yield from running(
        Cluster(
            tmp_path / "cluster",
            placement=[["s1", "s2"]],
            spec={"dead_letter_queue": "orders-dlq", "max_receive_count": 5},
            more_queues=[(QueueEntry("orders-dlq", {"shards": 1, "replicas": 2}), [["s2", "s3"]])],
        )
    )


@pytest.mark.timeout(120)
def test_on_a_cluster_any_server_passes_it_to_the_leader_and_the_copy_reaches_the_dlq(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        send_once_led(client, b"poison")
        (message,) = client.receive_messages("orders", max_messages=1, visibility_timeout_ms=60_000, wait_time_ms=5_000)
    # Through s3, which holds no copy of orders: forwarded to its leader, s1.
    with Client(cluster.endpoint("s3"), route_directly=False) as client:
        (result,) = client.release_messages("orders", [message.receipt], reason="rejected", dead_letter=True)
        assert result.ok
        (copy,) = dead_letters(client, 1, dlq="orders-dlq")
        assert (copy.body, copy.attributes[SOURCE], copy.attributes[LAST_ERROR]) == (b"poison", "orders", "rejected")
        assert stored_count(client, "orders") == 0


def test_the_cli_releases_or_dead_letters_by_receipt(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)

    def shardq(*args: str) -> subprocess.CompletedProcess[str]:
        return run_shardq(server.endpoint, *args)

    with Client(server.endpoint) as client:
        client.send_messages("jobs", [Message(b"poison")])
        (message,) = client.receive_messages("jobs", max_messages=1, visibility_timeout_ms=60_000)
        done = shardq("release", "--queue", "jobs", "--receipt", message.receipt, "--reason", "bad", "--dead-letter")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("dead-lettered\t")
        (copy,) = dead_letters(client, 1)
        assert copy.attributes[LAST_ERROR] == "bad"

        client.send_messages("plain", [Message(b"kept")])
        (message,) = client.receive_messages("plain", max_messages=1, visibility_timeout_ms=60_000)
        refused = shardq("release", "--queue", "plain", "--receipt", message.receipt, "--dead-letter")
        assert refused.returncode == 1
        assert "dead_letter: queue 'plain' has no dead-letter queue" in refused.stderr
        released = shardq("release", "--queue", "plain", "--receipt", message.receipt, "--receipt", "junk")
        assert released.returncode == 1
        assert released.stdout.splitlines()[0].startswith("released\t")
        assert "1 of 2 releases failed: MALFORMED_RECEIPT (the others were released)" in released.stderr
        assert stored_count(client, "plain") == 1
