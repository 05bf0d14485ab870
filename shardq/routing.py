"""Which shard a message belongs to, and which server leads each shard.

The rule is shared by servers and clients so that a client routing directly
puts every message exactly where a server would: messages with a dedup id
always on one shard (so the dedup window sees every repeat), FIFO messages with
their group (so a group's order is one shard's order), the rest round-robin.
"""

from __future__ import annotations

import zlib


def choose_shard(*, shards: int, fifo: bool, group_id: str, dedup_id: str, round_robin: int) -> int:
    if shards == 1:
        return 0
    if fifo and group_id:
        return zlib.crc32(group_id.encode()) % shards
    if dedup_id:
        return zlib.crc32(dedup_id.encode()) % shards
    return round_robin % shards
