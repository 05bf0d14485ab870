"""Which shard of a queue a message goes to: the shared rule of shardq.routing."""

from __future__ import annotations

from shard_server.domain.messages import NewMessage
from shardq.queues import QueueConfig
from shardq.routing import choose_shard as choose_shard_for


def choose_shard(config: QueueConfig, message: NewMessage, *, round_robin: int) -> int:
    return choose_shard_for(
        shards=config.shards,
        fifo=config.fifo,
        group_id=message.group_id,
        dedup_id=message.dedup_id,
        round_robin=round_robin,
    )
