"""Proto <-> runtime conversions for the queue API."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from shard_server.domain.messages import Delivery, MessageRecord, NewMessage, format_message_id
from shard_server.domain.sending import SendOutcome
from shard_server.domain.validation import validate_message, validate_send_batch
from shard_server.runtime.hosting import Peeked, Received
from shard_server.service.errors import entry_error
from shardq.api.v1 import queue_pb2
from shardq.errors import Reason
from shardq.queues import QueueConfig
from shardq.receipts import encode_receipt

Frame = TypeVar("Frame")


def messages_from_proto(
    config: QueueConfig, messages: Sequence[queue_pb2.MessageToSend], *, forwarded: bool = False
) -> list[NewMessage]:
    """The batch's messages, validated; reserved attributes only in a batch another server
    forwarded (dead letters it moves here)."""
    validate_send_batch(len(messages), sum(len(m.body) for m in messages))
    return [
        validate_message(
            config,
            index=index,
            body=message.body,
            attributes=message.attributes,
            group_id=message.group_id,
            dedup_id=message.dedup_id,
            delay_ms=message.delay_ms if message.HasField("delay_ms") else None,
            priority=message.priority,
            reserved_allowed=forwarded,
        )
        for index, message in enumerate(messages)
    ]


def send_response_to_proto(entries: Sequence[SendOutcome]) -> queue_pb2.SendMessagesResponse:
    response = queue_pb2.SendMessagesResponse()
    results = response.results
    for entry in entries:
        # Built in place: constructing each result first would copy it again.
        if entry.error is None:
            results.add(message_id=entry.message_id, duplicate=entry.duplicate, shard=entry.shard, seq=entry.seq)
        else:
            error = queue_pb2.EntryError(reason=entry.error.reason.value, message=entry.error.message)
            results.add(shard=entry.shard, error=error)
    return response


def received_frames(
    received: Received,
    max_batch: int,
    new_frame: Callable[[], tuple[Frame, queue_pb2.ReceiveMessagesResponse]],
    *,
    deleted: bool = False,
) -> list[Frame]:
    """The received messages in frames of at most `max_batch` messages each; `deleted`
    when the receive deleted them: no receipts then, nothing being left to act on (those
    another leader claimed come without, from it).

    `new_frame` returns a frame and the ReceiveMessagesResponse inside it to fill.
    Messages are built in place (`add`): building them first and then passing
    them to a response would copy every message again, on the drain's hot path.
    """
    frames: list[Frame] = []
    frame, batch = new_frame()
    # The frame's room is counted here, not read with len(batch.messages): reading
    # `messages` builds a wrapper each time, and with `add` looked up anew that was
    # 350 ns a message (a shared receive of 40: 100 against 86 µs, measured).
    add = batch.messages.add
    room = max_batch - len(batch.messages)
    for shard, message in received.local:
        if room <= 0:
            frames.append(frame)
            frame, batch = new_frame()
            add = batch.messages.add
            room = max_batch - len(batch.messages)
        room -= 1
        record = message.record
        delivery = message.delivery
        # Fields set one by one on the added message: a quarter faster than passing
        # them to add() as keywords (655 against 845 ns a message, measured).
        added = add()
        added.message_id = format_message_id(sent_at_ms=record.sent_at_ms, shard=shard.index, seq=record.seq)
        added.body = record.body
        if not deleted:
            added.receipt = encode_receipt(message.receipt)
            added.visible_until_ms = delivery.visible_at_ms
        added.receive_count = delivery.receive_count
        added.sent_at_ms = record.sent_at_ms
        added.first_received_at_ms = delivery.first_received_at_ms
        added.shard = shard.index
        added.seq = record.seq
        # Only when set: setting empty values still costs.
        if record.attributes:
            added.attributes.update(record.attributes)
        if record.group_id:
            added.group_id = record.group_id
        if record.dedup_id:
            added.dedup_id = record.dedup_id
        if delivery.priority:
            added.priority = delivery.priority
    for forwarded in received.remote:  # claimed by another leader for this call
        if len(batch.messages) >= max_batch:
            frames.append(frame)
            frame, batch = new_frame()
        batch.messages.append(forwarded)
    if batch.messages:
        frames.append(frame)
    return frames


def _plain_frame() -> tuple[queue_pb2.ReceiveMessagesResponse, queue_pb2.ReceiveMessagesResponse]:
    response = queue_pb2.ReceiveMessagesResponse()
    return response, response


def received_to_proto(received: Received, *, deleted: bool = False) -> queue_pb2.ReceiveMessagesResponse:
    frames = received_frames(received, max(len(received), 1), _plain_frame, deleted=deleted)
    return frames[0] if frames else queue_pb2.ReceiveMessagesResponse()


def shared_received_to_proto(parts: Sequence[Received], *, deleted: bool = False) -> queue_pb2.ReceiveMessagesResponse:
    """A shared receive's answer: every share's messages in order, and how many are whose."""
    response = queue_pb2.ReceiveMessagesResponse()
    for received in parts:
        before = len(response.messages)
        received_frames(received, sys.maxsize, lambda: (response, response), deleted=deleted)
        response.share_counts.append(len(response.messages) - before)
    return response


_OK = queue_pb2.EntryResult(ok=True)


def entry_results_to_proto(outcomes: Sequence[Reason | None]) -> list[queue_pb2.EntryResult]:
    return [
        _OK if reason is None else queue_pb2.EntryResult(ok=False, error=entry_error(reason)) for reason in outcomes
    ]


def config_to_proto(config: QueueConfig) -> queue_pb2.QueueConfig:
    return queue_pb2.QueueConfig(
        name=config.name,
        shards=config.shards,
        fifo=config.fifo,
        visibility_timeout_ms=config.visibility_timeout_ms,
        retention_ms=config.retention_ms,
        max_message_bytes=config.max_message_bytes,
        delivery_delay_ms=config.delivery_delay_ms,
        dedup_window_ms=config.dedup_window_ms,
        content_based_dedup=config.content_based_dedup,
        dead_letter_queue=config.dead_letter_queue,
        max_receive_count=config.max_receive_count,
        max_depth=config.max_depth,
        nack_backoff_base_ms=config.nack_backoff_base_ms,
        nack_backoff_max_ms=config.nack_backoff_max_ms,
        journal_retention_ms=config.journal_retention_ms,
        replicas=config.replicas,
        priority_lanes=config.priority_lanes,
        receive_wait_ms=config.receive_wait_ms,
    )


def peeked_to_proto(peeked: Peeked, *, max_messages: int) -> queue_pb2.ReceiveMessagesResponse:
    """The first `max_messages` of what every leader showed: highest priority, then oldest."""
    messages = [_peeked(shard, record, delivery) for shard, record, delivery in peeked.local]
    messages += peeked.remote
    messages.sort(key=lambda message: (-message.priority, message.sent_at_ms))
    return queue_pb2.ReceiveMessagesResponse(messages=messages[:max_messages])


def _peeked(shard: int, record: MessageRecord, delivery: Delivery) -> queue_pb2.ReceivedMessage:
    """A message as a peek shows it: everything but a receipt (nothing was claimed)."""
    return queue_pb2.ReceivedMessage(
        message_id=format_message_id(sent_at_ms=record.sent_at_ms, shard=shard, seq=record.seq),
        body=record.body,
        attributes=record.attributes,
        group_id=record.group_id,
        dedup_id=record.dedup_id,
        receive_count=delivery.receive_count,
        sent_at_ms=record.sent_at_ms,
        first_received_at_ms=delivery.first_received_at_ms,
        shard=shard,
        seq=record.seq,
        priority=delivery.priority,
    )
