"""Which shard of a queue a message goes to.

Messages with a dedup id always land on the same shard, so the dedup window
sees every repeat; FIFO messages follow their group, so a group's order is one
shard's order; everything else spreads round-robin.
"""

from __future__ import annotations

import zlib

from shard_server.domain.messages import NewMessage
from shardq.queues import QueueConfig


def choose_shard(config: QueueConfig, message: NewMessage, *, round_robin: int) -> int:
    if config.shards == 1:
        return 0
    if config.fifo and message.group_id:
        return zlib.crc32(message.group_id.encode()) % config.shards
    if message.dedup_id:
        return zlib.crc32(message.dedup_id.encode()) % config.shards
    return round_robin % config.shards
