"""A queue's receive wait (SQS's ReceiveMessageWaitTimeSeconds): a receive that gives no
wait of its own long-polls that long; one that gives 0 answers at once; the clients
follow a change of the setting within one receive."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.cli import run_shardq
from tests.support.servers import ServerFactory, ServerProcess

SENT_AFTER_S = 1.0


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory("waiting:receive_wait=20s,shards=2", "plain")


def test_a_receive_without_a_wait_waits_as_the_queue_says(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        at_once = stub.ReceiveMessages(
            queue_pb2.ReceiveMessagesRequest(queue="waiting", max_messages=1, wait_time_ms=0)
        )
        assert list(at_once.messages) == []
        assert at_once.queue_receive_wait_ms == 20_000
        with sending_later(server, "waiting"):
            waited = stub.ReceiveMessages(queue_pb2.ReceiveMessagesRequest(queue="waiting", max_messages=1), timeout=30)
        assert [m.body for m in waited.messages] == [b"later"]
        described = stub.DescribeQueue(queue_pb2.DescribeQueueRequest(queue="waiting"))
        assert described.config.receive_wait_ms == 20_000
        plain = stub.ReceiveMessages(queue_pb2.ReceiveMessagesRequest(queue="plain", max_messages=1), timeout=5)
        assert list(plain.messages) == []
        assert plain.queue_receive_wait_ms == 0


def test_the_client_and_cli_wait_as_the_queue_says_unless_told(server: ServerProcess) -> None:
    with Client(server.endpoint) as client, sending_later(server, "waiting"):
        assert client.receive_messages("waiting", wait_time_ms=0) == []
        assert [m.body for m in client.receive_messages("waiting")] == [b"later"]
    assert run_shardq(server.endpoint, "send", "--queue", "waiting", "--body", "now").returncode == 0
    received = run_shardq(server.endpoint, "receive", "--queue", "waiting")
    assert received.returncode == 0, received.stderr
    assert received.stdout.split("\t")[1].strip() == "now"


def test_a_client_follows_a_change_of_the_setting_within_one_receive(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.create_queue("changing")  # a queue made at run time: its settings may change
        assert client.receive_messages("changing") == []  # learns: the queue does not wait
        client.set_queue_attributes("changing", {"receiveWait": "20s"})
        with sending_later(server, "changing"):
            # The client may take the queue for one that does not wait once more: a short
            # poll, whose answer says the queue waits now...
            got = client.receive_messages("changing")
            if not got:
                # ...so the next receive waits, and gets the message sent meanwhile.
                got = client.receive_messages("changing")
            assert [m.body for m in got] == [b"later"]
        client.set_queue_attributes("changing", {"receiveWait": "0s"})
        with sending_later(server, "changing"):
            assert client.receive_messages("changing") == []  # the server's setting, at once
            assert client.receive_messages("changing") == []  # and the client's: a short poll


@contextlib.contextmanager
def sending_later(server: ServerProcess, queue: str) -> Iterator[None]:
    """A message sent to `queue` SENT_AFTER_S from now, in the background."""

    def send() -> None:
        with Client(server.endpoint) as client:
            client.send(queue, b"later")

    timer = threading.Timer(SENT_AFTER_S, send)
    timer.start()
    try:
        yield
    finally:
        timer.join()
