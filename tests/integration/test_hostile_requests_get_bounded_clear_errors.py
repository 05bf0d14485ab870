"""Hostile or broken input gets INVALID_ARGUMENT with an ErrorInfo naming the field, never
an echo of unbounded input, never UNKNOWN, never a silent drop: an oversized queue name,
an empty one, undecodable bytes on unary methods and on the producer stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from shardq import AsyncClient, Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import ERROR_DOMAIN, InvalidArgument, QueueFull, QueueNotFound
from tests.support.servers import ServerProcess, stored_count
from tests.support.status_details import error_info

QUEUE = "orders"
HUGE = "q" * 20_000
# Well under gRPC's 8 KiB default limit on received metadata.
MAX_ERROR_CHARS = 1_000
GARBAGE = b"\xff\xff\xff\xff\x0f this is not a protobuf message \x80"


NAMED: list[tuple[str, Callable[[Client, str], object]]] = [
    ("send", lambda c, q: c.send_messages(q, [Message(b"x")])),
    ("receive", lambda c, q: c.receive_messages(q, max_messages=1)),
    ("attributes", lambda c, q: c.attributes(q)),
    ("purge", lambda c, q: c.purge(q)),
]


@pytest.mark.parametrize(("call", "operation"), NAMED, ids=[name for name, _ in NAMED])
def test_an_oversized_queue_name_is_refused_without_being_echoed(
    server: ServerProcess, call: str, operation: Callable[[Client, str], object]
) -> None:
    with Client(server.endpoint) as client, pytest.raises(InvalidArgument) as refused:
        operation(client, HUGE)
    assert refused.value.field == "queue"
    assert len(str(refused.value)) < MAX_ERROR_CHARS
    assert "20000 characters" in str(refused.value)


@pytest.mark.parametrize(("call", "operation"), NAMED, ids=[name for name, _ in NAMED])
def test_an_empty_queue_name_is_an_invalid_argument(
    server: ServerProcess, call: str, operation: Callable[[Client, str], object]
) -> None:
    with Client(server.endpoint) as client, pytest.raises(InvalidArgument) as refused:
        operation(client, "")
    assert refused.value.field == "queue"


def test_an_unknown_but_well_formed_queue_is_still_not_found(server: ServerProcess) -> None:
    with Client(server.endpoint) as client, pytest.raises(QueueNotFound) as refused:
        client.send_messages("no-such-queue", [Message(b"x")])
    assert "no-such-queue" in str(refused.value)


UNARY_METHODS = ["SendMessages", "ReceiveMessages", "DeleteMessages", "GetQueueAttributes", "PurgeQueue"]


@pytest.mark.parametrize("method", UNARY_METHODS)
def test_undecodable_unary_requests_are_invalid_arguments(server: ServerProcess, method: str) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        call = channel.unary_unary(f"/shardq.v1.QueueService/{method}")
        with pytest.raises(grpc.RpcError) as refused:
            call(GARBAGE, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    info = error_info(refused.value)
    assert info.reason == "INVALID_ARGUMENT"
    assert info.domain == ERROR_DOMAIN
    assert info.metadata["field"] == "request"
    assert server.alive()


def test_an_undecodable_frame_on_the_send_stream_ends_it_with_invalid_argument(server: ServerProcess) -> None:
    good = queue_pb2.SendStreamRequest(
        request_id=1,
        batch=queue_pb2.SendMessagesRequest(queue=QUEUE, messages=[queue_pb2.MessageToSend(body=b"before")]),
    ).SerializeToString()
    with grpc.insecure_channel(server.endpoint) as channel:
        call = channel.stream_stream("/shardq.v1.QueueService/SendStream")
        responses = call(iter([good, GARBAGE]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in responses:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert error_info(refused.value).metadata["field"] == "request"
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == 1


def test_streamed_send_errors_name_their_queue(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory("small:max_depth=1")
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        requests = [
            queue_pb2.SendStreamRequest(
                request_id=n,
                batch=queue_pb2.SendMessagesRequest(queue="small", messages=[queue_pb2.MessageToSend(body=b"m")]),
            )
            for n in (1, 2)
        ]
        answers = list(stub.SendStream(iter(requests), timeout=10))
    refusals = [answer.error.message for answer in answers if answer.HasField("error")]
    refusals += [
        result.error.message for answer in answers for result in answer.response.results if result.HasField("error")
    ]
    assert refusals, answers
    assert all("'small'" in message for message in refusals), refusals


def test_a_refusal_over_the_producer_stream_names_its_queue(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory("small:max_depth=1")

    async def overfill() -> QueueFull:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages_streamed("small", [Message(b"fits")])
            with pytest.raises(QueueFull) as refused:
                await client.send_messages_streamed("small", [Message(b"does not")])
            return refused.value

    refusal = asyncio.run(overfill())
    assert "'small'" in str(refusal), refusal
