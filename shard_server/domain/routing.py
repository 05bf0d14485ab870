"""Which shard of a queue a message goes to: the shared rule of shardq.routing."""

from __future__ import annotations

from collections.abc import Sequence

from shard_server.domain.messages import NewMessage
from shardq.queues import QueueConfig
from shardq.routing import choose_shard as choose_shard_for
from shardq.routing import content_dedup_id


def choose_shard(config: QueueConfig, message: NewMessage, *, round_robin: int) -> int:
    return choose_shard_for(
        shards=config.shards,
        fifo=config.fifo,
        group_id=message.group_id,
        dedup_id=message.dedup_id,
        round_robin=round_robin,
    )


def give_content_dedup_ids(messages: Sequence[NewMessage]) -> bool:
    """Give each message sent without a dedup id its body's (a queue with content-based
    dedup); whether any lacked one. The messages are this call's own, built from its request."""
    gave = False
    for message in messages:
        if not message.dedup_id:
            message.dedup_id = content_dedup_id(message.body)
            gave = True
    return gave
