"""A stream's client that writes and never reads is held back, not buffered without bound;
a consume stream's acknowledgements are bounded as DeleteMessages is; a second start is
refused, not ignored. Each was found by an adversarial client against a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import Reason
from shardq.status import error_from_rpc
from tests.support.servers import ServerFactory, ServerProcess, drain

QUEUE = "orders"
# Well past what HTTP/2's windows hold (tens of MB), so a server reading all of it could
# not pass for one that stopped reading.
REQUESTS = 20_000
# The server's growth while held back: its limits' worth of answers and windows, a few MB.
# Reading everything once grew it by hundreds of MB.
MAX_GROWTH_KB = 100 * 1024
# A client that reads slowly, as these read nothing: its window for answers stays at
# HTTP/2's 64 KiB instead of growing with the bandwidth gRPC measures, so small answers
# fill it after hundreds, not hundreds of thousands.
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65_536)]


def rss_kb(server: ServerProcess) -> int:
    with open(f"/proc/{server.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Unread:
    """Runs a stream whose requests come from `requests` and whose answers nobody reads,
    counting the requests gRPC took from the iterator."""

    def __init__(self, method: grpc.StreamStreamMultiCallable[Any, Any], requests: Iterator[object]) -> None:
        self.taken = 0
        self._done = threading.Event()

        def counted() -> Iterator[object]:
            for request in requests:
                yield request
                self.taken += 1
            self._done.wait(60)

        self.call = method(counted(), timeout=90)

    def until_held(self, *, total: int, timeout: float = 60) -> int:
        """How many requests were taken once taking stopped for 3 s (or all were)."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline and self.taken < total:
            if self.taken != last:
                last, since = self.taken, time.monotonic()
            elif time.monotonic() - since > 3:
                break
            time.sleep(0.1)
        return self.taken

    def cancel(self) -> None:
        self._done.set()
        self.call.cancel()


def assert_serves(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        sent = client.send_messages(QUEUE, [Message(b"after")])
        assert [m.message_id for m in drain(client, QUEUE)] == [sent[0].message_id]
    # A client that goes away is not the server's error (gRPC logged a traceback at
    # error level for each answer it could no longer write).
    errors = [line for line in server.log().splitlines() if '"level": "error"' in line]
    assert not errors, errors[0]


def assert_held_back(
    server: ServerProcess,
    method: Callable[[queue_pb2_grpc.QueueServiceStub], grpc.StreamStreamMultiCallable[Any, Any]],
    requests: Iterator[object],
    *,
    total: int,
    what: str,
) -> None:
    """The server stops reading `requests` from a client that reads none of its answers,
    and stays small and serving."""
    before = rss_kb(server)
    with grpc.insecure_channel(server.endpoint, options=SLOW_READER) as channel:
        stream = Unread(method(queue_pb2_grpc.QueueServiceStub(channel)), requests)
        try:
            taken = stream.until_held(total=total)
            grown = rss_kb(server) - before
        finally:
            stream.cancel()
    assert taken < total, f"the server read all {taken} {what} of a client that read no answer"
    assert grown < MAX_GROWTH_KB, f"the server grew by {grown // 1024} MB holding a client's unread answers"
    assert_serves(server)


def test_a_consume_stream_whose_client_reads_nothing_stops_reading_its_acks(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")

    def requests() -> Iterator[queue_pb2.ConsumeRequest]:
        yield queue_pb2.ConsumeRequest(start=queue_pb2.ConsumeStart(queue=QUEUE))
        for ack_id in range(REQUESTS):
            # Receipts that are not receipts: each gets its own MALFORMED_RECEIPT.
            acknowledge = queue_pb2.Acknowledge(ack_id=ack_id, receipts=[""] * 1000)
            yield queue_pb2.ConsumeRequest(ack=acknowledge)

    assert_held_back(server, lambda stub: stub.ConsumeStream, requests(), total=REQUESTS + 1, what="acknowledgements")


def test_a_producer_stream_whose_client_reads_nothing_stops_reading_its_sends(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")
    body = b"x" * 4096

    def requests() -> Iterator[queue_pb2.SendStreamRequest]:
        for request_id in range(REQUESTS):
            # To a queue that does not exist: answered at once, stored nowhere.
            message = queue_pb2.MessageToSend(body=body)
            batch = queue_pb2.SendMessagesRequest(queue="no-such-queue", messages=[message])
            yield queue_pb2.SendStreamRequest(request_id=request_id, batch=batch)

    assert_held_back(server, lambda stub: stub.SendStream, requests(), total=REQUESTS, what="sends")


def consume(stub: queue_pb2_grpc.QueueServiceStub, requests: list[queue_pb2.ConsumeRequest]) -> Iterator[object]:
    stop = threading.Event()

    def held_open() -> Iterator[queue_pb2.ConsumeRequest]:
        yield from requests
        stop.wait(30)

    call = stub.ConsumeStream(held_open(), timeout=30)
    try:
        yield from call
    finally:
        stop.set()
        call.cancel()


@pytest.mark.parametrize("field", ["receipts", "release"])
def test_an_acknowledgement_of_over_a_thousand_receipts_is_refused_whole(
    server_factory: ServerFactory, field: str
) -> None:
    server = server_factory(f"{QUEUE}:shards=1")
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"kept")])
        (message,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        oversized = queue_pb2.Acknowledge(ack_id=1)
        getattr(oversized, field).extend([message.receipt] * 1001)
        valid = queue_pb2.Acknowledge(ack_id=2, receipts=[message.receipt])
        requests = [
            queue_pb2.ConsumeRequest(start=queue_pb2.ConsumeStart(queue=QUEUE)),
            queue_pb2.ConsumeRequest(ack=oversized),
            queue_pb2.ConsumeRequest(ack=valid),
        ]
        answers: dict[int, queue_pb2.AckResult] = {}
        for response in consume(stub, requests):
            assert isinstance(response, queue_pb2.ConsumeResponse)
            if response.HasField("ack"):
                answers[response.ack.ack_id] = response.ack
            if len(answers) == 2:
                break
    refused = answers[1]
    assert refused.failed.reason == Reason.INVALID_ARGUMENT.value
    assert refused.failed.field == f"ack.{field}"
    assert "1..1000" in refused.failed.message
    assert not refused.deleted
    assert not refused.released
    # The stream goes on, and nothing was released by the refused frame: the valid
    # acknowledgement after it deletes the message with the same receipt.
    assert [entry.ok for entry in answers[2].deleted] == [True]
    with Client(server.endpoint) as client:
        assert drain(client, QUEUE) == []


def test_a_second_start_ends_the_consume_stream_with_a_reason(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=1")
    start = queue_pb2.ConsumeRequest(start=queue_pb2.ConsumeStart(queue=QUEUE))
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in consume(stub, [start, start]):
                pass
    error = error_from_rpc(raised.value)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason is Reason.INVALID_ARGUMENT
    assert error.field == "kind"
    assert_serves(server)
