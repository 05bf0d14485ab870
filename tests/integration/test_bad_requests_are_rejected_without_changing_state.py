"""Validation: each bad request names its field, and a rejected request changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from shardq import Client, InvalidArgument, Message, QueueNotFound, Reason
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import ERROR_DOMAIN
from shardq.queues import MAX_ATTRIBUTES, MIB
from tests.support.servers import ServerProcess, drain
from tests.support.status_details import error_info

QUEUE = "orders"
DAY_MS = 86_400_000
# The default retention of `orders` is four days.
BEYOND_RETENTION_MS = 5 * DAY_MS

BadCall = Callable[[Client], object]

INVALID: list[tuple[str, str, BadCall]] = [
    ("oversized body", "messages[0].body", lambda c: c.send_messages(QUEUE, [Message(b"x" * (MIB + 1))])),
    (
        "oversized second body",
        "messages[1].body",
        lambda c: c.send_messages(QUEUE, [Message(b"fine"), Message(b"x" * (MIB + 1))]),
    ),
    (
        "too many attributes",
        "messages[0].attributes",
        lambda c: c.send_messages(QUEUE, [Message(b"a", {f"k{i}": "v" for i in range(MAX_ATTRIBUTES + 1)})]),
    ),
    ("batch over 1000", "messages", lambda c: c.send_messages(QUEUE, [Message(b"m")] * 1001)),
    ("empty batch", "messages", lambda c: c.send_messages(QUEUE, [])),
    ("negative delay", "messages[0].delay_ms", lambda c: c.send_messages(QUEUE, [Message(b"d", delay_ms=-1)])),
    (
        "delay beyond retention",
        "messages[0].delay_ms",
        lambda c: c.send_messages(QUEUE, [Message(b"d", delay_ms=BEYOND_RETENTION_MS)]),
    ),
    (
        "group id too long",
        "messages[0].group_id",
        lambda c: c.send_messages(QUEUE, [Message(b"g", group_id="g" * 129)]),
    ),
    (
        "negative visibility",
        "visibility_timeout_ms",
        lambda c: c.receive_messages(QUEUE, visibility_timeout_ms=-1),
    ),
    (
        "absurd visibility",
        "visibility_timeout_ms",
        lambda c: c.receive_messages(QUEUE, visibility_timeout_ms=10 * 365 * DAY_MS),
    ),
    ("negative wait", "wait_time_ms", lambda c: c.receive_messages(QUEUE, wait_time_ms=-1)),
    ("absurd wait", "wait_time_ms", lambda c: c.receive_messages(QUEUE, wait_time_ms=DAY_MS)),
    ("zero max messages", "max_messages", lambda c: c.receive_messages(QUEUE, max_messages=0)),
    ("too many max messages", "max_messages", lambda c: c.receive_messages(QUEUE, max_messages=1001)),
    # Counts a request cannot hold: protobuf's bare ValueError once reached the caller.
    ("negative max messages", "max_messages", lambda c: c.receive_messages(QUEUE, max_messages=-1)),
    ("max messages past uint32", "max_messages", lambda c: c.receive_messages(QUEUE, max_messages=2**32)),
    ("negative peek", "max_messages", lambda c: c.peek_messages(QUEUE, max_messages=-1)),
    (
        "negative redrive count",
        "max_messages",
        lambda c: list(c.redrive(source="orders-dlq", destination=QUEUE, max_messages=-1)),
    ),
    ("no receipts", "receipts", lambda c: c.delete_messages(QUEUE, [])),
    ("too many receipts", "receipts", lambda c: c.delete_messages(QUEUE, ["r"] * 1001)),
    (
        "negative visibility change",
        "changes[0].visibility_timeout_ms",
        lambda c: c.change_visibility(QUEUE, [("r", -5)]),
    ),
]


@pytest.fixture
def stored(client: Client) -> list[str]:
    """Five visible messages whose ids are returned."""
    results = client.send_messages(QUEUE, [Message(b"keep %d" % i) for i in range(5)])
    return sorted(r.message_id for r in results)


def assert_unchanged(client: Client, stored: list[str]) -> None:
    attributes = client.attributes(QUEUE)
    assert (attributes.visible, attributes.in_flight, attributes.delayed) == (5, 0, 0)


def test_each_bad_request_names_its_field_and_changes_nothing(client: Client, stored: list[str]) -> None:
    for case, field, call in INVALID:
        with pytest.raises(InvalidArgument) as raised:
            call(client)
        assert raised.value.field == field, case
        assert raised.value.reason == Reason.INVALID_ARGUMENT, case
        assert_unchanged(client, stored)
    assert sorted(m.message_id for m in drain(client, QUEUE)) == stored


def test_unknown_queue_is_not_found(client: Client, stored: list[str]) -> None:
    calls: list[BadCall] = [
        lambda c: c.send_messages("nope", [Message(b"x")]),
        lambda c: c.receive_messages("nope"),
        lambda c: c.delete_messages("nope", ["r"]),
        lambda c: c.attributes("nope"),
        lambda c: c.purge("nope"),
    ]
    for call in calls:
        with pytest.raises(QueueNotFound) as raised:
            call(client)
        assert raised.value.reason == Reason.QUEUE_NOT_FOUND
    assert_unchanged(client, stored)


def test_malformed_receipts_are_rejected_per_entry_and_change_nothing(client: Client, stored: list[str]) -> None:
    results = client.delete_messages(QUEUE, ["junk", "", "A" * 64])
    assert [(r.ok, r.reason) for r in results] == [(False, Reason.MALFORMED_RECEIPT)] * 3
    results = client.change_visibility(QUEUE, [("junk", 1_000)])
    assert [(r.ok, r.reason) for r in results] == [(False, Reason.MALFORMED_RECEIPT)]
    assert_unchanged(client, stored)
    assert sorted(m.message_id for m in drain(client, QUEUE)) == stored


def test_raw_grpc_status_carries_error_info(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        oversized = queue_pb2.SendMessagesRequest(
            queue=QUEUE, messages=[queue_pb2.MessageToSend(body=b"x" * (MIB + 1))]
        )
        with pytest.raises(grpc.RpcError) as raised:
            stub.SendMessages(oversized)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = error_info(raised.value)
        assert (info.reason, info.domain, info.metadata["field"]) == (
            "INVALID_ARGUMENT",
            ERROR_DOMAIN,
            "messages[0].body",
        )

        bad_wait = queue_pb2.ReceiveMessagesRequest(queue=QUEUE, max_messages=1, wait_time_ms=-1)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ReceiveMessages(bad_wait)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(raised.value).metadata["field"] == "wait_time_ms"

        with pytest.raises(grpc.RpcError) as raised:
            stub.GetQueueAttributes(queue_pb2.GetQueueAttributesRequest(queue="nope"))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_info(raised.value).reason == "QUEUE_NOT_FOUND"
