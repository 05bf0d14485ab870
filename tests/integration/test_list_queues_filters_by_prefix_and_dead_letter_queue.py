"""ListQueues narrows by name prefix (SQS's QueueNamePrefix) and by dead-letter queue
(SQS's ListDeadLetterSourceQueues: which queues a redrive of it would return messages
to), from Python, over raw gRPC and from the CLI. A prefix no queue name can start with,
or a dead-letter queue that is not a name, is INVALID_ARGUMENT naming the field; one that
does not exist is QUEUE_NOT_FOUND."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import ERROR_DOMAIN, InvalidArgument, QueueNotFound
from tests.support.cli import run_shardq
from tests.support.servers import ServerProcess
from tests.support.status_details import error_info

# Beside the server fixture's orders (dead letters to orders-dlq), orders-dlq and fifo.
MADE = {
    "orders-eu": {"deadLetterQueue": "orders-dlq", "maxReceiveCount": "3"},
    "orders-eu-dlq": {},
    "orders-eu-retries": {"deadLetterQueue": "orders-eu-dlq", "maxReceiveCount": "5"},
    "payments": {"deadLetterQueue": "orders-dlq", "maxReceiveCount": "2"},
}


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint) as client:
        for name, settings in MADE.items():
            client.create_queue(name, settings)
        yield client


def test_a_prefix_and_a_dead_letter_queue_narrow_the_list(client: Client) -> None:
    everything = ["fifo", "orders", "orders-dlq", "orders-eu", "orders-eu-dlq", "orders-eu-retries", "payments"]
    assert client.list_queues() == everything
    assert client.list_queues("orders-eu") == ["orders-eu", "orders-eu-dlq", "orders-eu-retries"]
    assert client.list_queues("orders-") == ["orders-dlq", "orders-eu", "orders-eu-dlq", "orders-eu-retries"]
    assert client.list_queues("nothing-here") == []
    assert client.list_queues(dead_letter_queue="orders-dlq") == ["orders", "orders-eu", "payments"]
    assert client.list_queues(dead_letter_queue="orders-eu-dlq") == ["orders-eu-retries"]
    assert client.list_queues(dead_letter_queue="fifo") == []  # a queue no other sends dead letters to
    assert client.list_queues("orders", dead_letter_queue="orders-dlq") == ["orders", "orders-eu"]


def test_a_prefix_no_name_can_start_with_is_invalid_naming_the_field(client: Client) -> None:
    for prefix in ("Orders", "orders_", "-orders", "o" * 64):
        with pytest.raises(InvalidArgument) as refused:
            client.list_queues(prefix)
        assert refused.value.field == "prefix", prefix
        assert "no queue name starts with" in str(refused.value)


def test_a_dead_letter_queue_that_is_no_name_or_missing_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument) as refused:
        client.list_queues(dead_letter_queue="Orders_DLQ")
    assert refused.value.field == "dead_letter_queue"
    assert "is not a queue name" in str(refused.value)
    with pytest.raises(QueueNotFound) as missing:
        client.list_queues(dead_letter_queue="no-such-dlq")
    assert "'no-such-dlq' does not exist" in str(missing.value)


def test_raw_grpc_gets_the_status_and_error_info(client: Client, server: ServerProcess) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        listed = stub.ListQueues(queue_pb2.ListQueuesRequest(prefix="pay"), timeout=5)
        assert list(listed.queues) == ["payments"]
        with pytest.raises(grpc.RpcError) as raised:
            stub.ListQueues(queue_pb2.ListQueuesRequest(prefix="Pay"), timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = error_info(raised.value)
        assert (info.reason, info.domain, info.metadata["field"]) == ("INVALID_ARGUMENT", ERROR_DOMAIN, "prefix")
        with pytest.raises(grpc.RpcError) as raised:
            stub.ListQueues(queue_pb2.ListQueuesRequest(dead_letter_queue="gone"), timeout=5)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_info(raised.value).reason == "QUEUE_NOT_FOUND"


def test_the_cli_lists_by_prefix_and_dead_letter_queue(client: Client, server: ServerProcess) -> None:
    def listed(*args: str) -> subprocess.CompletedProcess[str]:
        return run_shardq(server.endpoint, "queues", *args)

    def names(done: subprocess.CompletedProcess[str]) -> list[str]:
        assert done.returncode == 0, done.stderr
        return [line.split()[0] for line in done.stdout.splitlines()[1:]]

    assert names(listed("--prefix", "orders-eu")) == ["orders-eu", "orders-eu-dlq", "orders-eu-retries"]
    assert names(listed("--dead-letter-queue", "orders-dlq")) == ["orders", "orders-eu", "payments"]
    refused = listed("--prefix", "Orders")
    assert refused.returncode == 1
    assert "prefix: no queue name starts with 'Orders'" in refused.stderr
