"""Storing new messages: idempotence through dedup ids, and backpressure."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shard_server.domain.context import ShardContext, commit_event
from shard_server.domain.events import Sent
from shard_server.domain.messages import (
    Delivery,
    DeliveryState,
    MessageRecord,
    NewMessage,
    first_claim_token,
    format_message_id,
)
from shard_server.domain.store import ShardStore
from shardq.errors import QueueFull, ShardqError

# How long a producer refused for depth should wait: long enough for consumers
# to make room, short enough that a drained queue refills promptly.
QUEUE_FULL_RETRY_AFTER_MS = 1_000


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class SendOutcome:
    """One message of a send batch: stored, a duplicate of a stored one, or refused
    (`error` set; refusals are decided where the shard is, e.g. NOT_LEADER)."""

    message_id: str
    seq: int
    shard: int
    duplicate: bool
    error: ShardqError | None = None


def send_messages(
    store: ShardStore,
    context: ShardContext,
    messages: Sequence[NewMessage],
    *,
    now_ms: int,
    other_shards_depth: int = 0,
) -> list[SendOutcome]:
    """Store the messages, or raise QueueFull having stored none of them.

    `max_depth` bounds the whole queue: `other_shards_depth` is what the queue's
    other shards hold, so a queue drained below its limit accepts sends on any
    shard, however unevenly its shards filled.
    """
    max_depth = context.config.max_depth
    if max_depth and store.message_count() + other_shards_depth + len(messages) > max_depth:
        raise QueueFull(context.config.name, QUEUE_FULL_RETRY_AFTER_MS)
    window = context.config.dedup_window_ms
    outcomes: list[SendOutcome] = []
    seq = store.last_seq()
    first_token = first_claim_token(now_ms)
    for message in messages:
        if message.dedup_id and window:
            original = store.dedup_lookup(message.dedup_id)
            if original is not None and original[2] > now_ms:
                original_seq, original_sent_at, _ = original
                original_id = format_message_id(sent_at_ms=original_sent_at, shard=context.shard, seq=original_seq)
                outcomes.append(SendOutcome(original_id, original_seq, context.shard, duplicate=True))
                continue
        seq += 1
        record = MessageRecord(
            seq=seq,
            sent_at_ms=now_ms,
            body=message.body,
            attributes=message.attributes,
            group_id=message.group_id,
            dedup_id=message.dedup_id,
            source_queue=message.source_queue,
        )
        delivery = Delivery(
            seq=seq,
            state=DeliveryState.READY,
            sent_at_ms=now_ms,
            visible_at_ms=now_ms + message.delay_ms,
            claim_token=first_token,
            priority=message.priority,
        )
        expires = now_ms + window if message.dedup_id and window else 0
        commit_event(store, context, Sent(record, delivery, expires), now_ms=now_ms)
        outcomes.append(
            SendOutcome(
                format_message_id(sent_at_ms=now_ms, shard=context.shard, seq=seq), seq, context.shard, duplicate=False
            )
        )
    return outcomes
