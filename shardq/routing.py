"""Which shard a message belongs to, and which server leads each shard.

The rule is shared by servers and clients so that a client routing directly
puts every message exactly where a server would: messages with a dedup id
always on one shard (so the dedup window sees every repeat), FIFO messages with
their group (so a group's order is one shard's order), the rest round-robin.
On a queue with content-based dedup, a message sent without a dedup id has one
made from its body before it is routed, by clients and servers alike.
"""

from __future__ import annotations

import hashlib
import zlib

CONTENT_DEDUP_PREFIX = "sha256:"


def content_dedup_id(body: bytes) -> str:
    """The dedup id of a message sent without one to a queue with content-based dedup:
    SHA-256 of the body alone, as SQS's ContentBasedDeduplication (attributes, group
    and delay are not part of it: the same body sent again is the repeat)."""
    return CONTENT_DEDUP_PREFIX + hashlib.sha256(body).hexdigest()


def choose_shard(*, shards: int, fifo: bool, group_id: str, dedup_id: str, round_robin: int) -> int:
    if shards == 1:
        return 0
    if fifo and group_id:
        return zlib.crc32(group_id.encode()) % shards
    if dedup_id:
        return zlib.crc32(dedup_id.encode()) % shards
    return round_robin % shards
