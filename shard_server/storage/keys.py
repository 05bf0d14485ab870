"""Every LMDB key layout in one place.

Integers are fixed-width big-endian, so LMDB's byte order is numeric order:
the delivery index sorts by (visible_at_ms, seq) and the log by index.
"""

from __future__ import annotations

import struct

U64 = struct.Struct(">Q")
PAIR = struct.Struct(">QQ")
LANE_TRIPLE = struct.Struct(">BQQ")

# Named databases of one shard environment.
DB_MESSAGES = b"messages"  # seq -> MessageRecord
DB_DELIVERY = b"delivery"  # seq -> Delivery
DB_INDEX = b"index"  # (visible_at_ms, seq) -> b""   READY and CLAIMED messages
DB_DEAD_LETTERS = b"dead_letters"  # seq -> b""      DEAD_LETTER_PENDING messages
# (255 - priority, visible_at_ms, seq) -> b"": the DB_INDEX entries of messages of a
# priority above 0 again, highest lane first (a queue without lanes leaves it empty).
DB_PRIORITY_INDEX = b"priority_index"
DB_DEDUP = b"dedup"  # dedup id -> (seq, sent_at_ms, expires_at_ms)
DB_DEDUP_EXPIRY = b"dedup_expiry"  # (expires_at_ms, dedup id) -> b""
DB_GROUPS = b"groups"  # group id, NUL, seq -> b""
DB_META = b"meta"  # name -> value
DB_LOG = b"log"  # log index -> LogEntry
ALL_DBS = (
    DB_MESSAGES,
    DB_DELIVERY,
    DB_INDEX,
    DB_PRIORITY_INDEX,
    DB_DEAD_LETTERS,
    DB_DEDUP,
    DB_DEDUP_EXPIRY,
    DB_GROUPS,
    DB_META,
    DB_LOG,
)

META_LAST_SEQ = b"last_seq"
META_LAST_INDEX = b"last_index"
META_EPOCH = b"epoch"  # the highest epoch this replica has seen (fencing)
META_EPOCH_LEADER = b"epoch_leader"  # the server that led that epoch, as this replica saw it
# Set when another server appended at that epoch: this replica's entries of it may match
# the other's by index and epoch, so it copies a snapshot of its next leader's instead.
META_EPOCH_CONFLICT = b"epoch_conflict"
META_APPLIED_INDEX = b"applied_index"  # log entries applied to the state, in order
META_INCARNATION = b"incarnation"  # random per copy of the data; a wiped replica gets a new one
META_IDENTITY = b"identity"  # queue name and shard number, checked on open

DEDUP_VALUE = struct.Struct(">QqQ")


def seq_key(seq: int) -> bytes:
    return U64.pack(seq)


def index_key(visible_at_ms: int, seq: int) -> bytes:
    return PAIR.pack(visible_at_ms, seq)


def parse_index_key(key: bytes | memoryview) -> tuple[int, int]:
    visible_at, seq = PAIR.unpack(key)
    return visible_at, seq


def priority_index_key(priority: int, visible_at_ms: int, seq: int) -> bytes:
    return LANE_TRIPLE.pack(255 - priority, visible_at_ms, seq)


def parse_priority_index_key(key: bytes | memoryview) -> tuple[int, int, int]:
    """(255 - priority, visible_at_ms, seq): ordered as the index orders them."""
    lane, visible_at, seq = LANE_TRIPLE.unpack(key)
    return lane, visible_at, seq


def dedup_expiry_key(expires_at_ms: int, dedup_id: str) -> bytes:
    return U64.pack(expires_at_ms) + dedup_id.encode()


def group_prefix(group_id: str) -> bytes:
    # Group ids are printable, so NUL cannot occur inside one and ends the prefix.
    return group_id.encode() + b"\0"


def group_key(group_id: str, seq: int) -> bytes:
    return group_prefix(group_id) + U64.pack(seq)
