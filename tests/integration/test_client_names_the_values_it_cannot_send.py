"""Values a request cannot hold are refused by the client with InvalidArgument naming the
message or field, as the server names what it refuses: they raised protobuf's bare
TypeError or ValueError, which said neither which message nor which field. Nothing is
sent for them. A real server behind the client."""

from __future__ import annotations

from typing import Any

import pytest

from shardq import Client, InvalidArgument, Message
from tests.support.servers import ServerProcess


def refused(call: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as raised:
        call()
    return raised.value


def test_a_message_protobuf_cannot_hold_is_named(server: ServerProcess, client: Client) -> None:
    cases: list[tuple[list[Message], str]] = [
        ([Message("not bytes")], "messages[0]"),  # type: ignore[arg-type]
        ([Message(b"fine"), Message(b"x", {"attempt": 1})], "messages[1]"),  # type: ignore[dict-item]
        ([Message(b"x", delay_ms=2**64)], "messages[0]"),
    ]
    for messages, field in cases:
        error = refused(lambda messages=messages: client.send_messages("orders", messages))
        assert error.field == field, (messages, error)
        assert "cannot be sent as given" in error.message, error.message
    assert client.attributes("orders").visible == 0, "a refused batch stored some of its messages"


def test_a_duration_past_int64_is_refused_by_name(server: ServerProcess, client: Client) -> None:
    error = refused(lambda: client.receive_messages("orders", visibility_timeout_ms=2**70))
    assert error.field == "visibility_timeout_ms", error
    error = refused(lambda: client.receive_messages("orders", wait_time_ms=2**70))
    assert error.field == "wait_time_ms", error
    client.send_messages("orders", [Message(b"claimed")])
    (received,) = client.receive_messages("orders", max_messages=1, wait_time_ms=5_000)
    error = refused(lambda: client.change_visibility("orders", [(received.receipt, 0), (received.receipt, 2**70)]))
    assert error.field == "changes[1].visibility_timeout_ms", error
    assert client.attributes("orders").in_flight == 1, "the refused change changed something"
