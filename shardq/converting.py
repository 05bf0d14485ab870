"""The client's messages and answers to and from their protobuf form."""

from __future__ import annotations

from typing import Any

from shardq.api.v1 import queue_pb2
from shardq.types import Message, ReceivedMessage, SendResult


def message_to_proto(message: Message) -> queue_pb2.MessageToSend:
    proto = queue_pb2.MessageToSend(
        body=message.body, attributes=message.attributes, group_id=message.group_id, dedup_id=message.dedup_id
    )
    if message.delay_ms is not None:
        proto.delay_ms = message.delay_ms
    if message.priority:
        proto.priority = message.priority
    return proto


def send_results_from_proto(response: queue_pb2.SendMessagesResponse) -> list[SendResult]:
    return [
        SendResult(r.message_id, r.duplicate, r.shard, r.seq, r.error.reason, r.error.message) for r in response.results
    ]


def received_from_proto(response: queue_pb2.ReceiveMessagesResponse) -> list[ReceivedMessage]:
    # Positional, and no dict() of an empty map: this runs for every message received.
    return [
        ReceivedMessage(
            m.message_id,
            m.body,
            dict(m.attributes) if m.attributes else {},
            m.group_id,
            m.dedup_id,
            m.receipt,
            m.receive_count,
            m.sent_at_ms,
            m.first_received_at_ms,
            m.visible_until_ms,
            m.shard,
            m.seq,
            m.priority,
        )
        for m in response.messages
    ]


def settings_from_proto(config: queue_pb2.QueueConfig) -> dict[str, Any]:
    """A queue's settings by name (durations in ms), name excluded. Every one, zeros
    too: ListFields leaves out proto3's zero values, and a queue with a visibility
    timeout or dedup window of 0 read as if it had the defaults."""
    return {field.name: getattr(config, field.name) for field in config.DESCRIPTOR.fields if field.name != "name"}
