"""Work and reads for tests that drive a GroupCommitter over a real ShardEnvironment."""

from __future__ import annotations

from collections.abc import Callable

from shard_server.domain import sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.storage.lmdb_store import LmdbShardTransaction, ShardEnvironment


def send(*bodies: bytes) -> Callable[[LmdbShardTransaction, ShardContext, int], list[sending.SendOutcome]]:
    """Work sending one message per body, as one call."""
    messages = [NewMessage(body=body, attributes={}, group_id="", dedup_id="", delay_ms=0) for body in bodies]
    return lambda tx, context, now: sending.send_messages(tx, context, messages, now_ms=now)


def stored_bodies(environment: ShardEnvironment) -> list[bytes]:
    """The bodies LMDB holds (committed), oldest first."""
    with environment.read() as tx:
        seqs = [seq for seq, _ in tx.oldest_messages(after_seq=0, limit=100)]
        records = [tx.get_record(seq) for seq in seqs]
    return [record.body for record in records if record is not None]
