"""Time-driven and administrative changes: retention, dedup pruning, purge,
and completing dead-letter hand-overs."""

from __future__ import annotations

from collections.abc import Iterable

from shard_server.domain.context import ShardContext, commit_event
from shard_server.domain.events import DedupPruned, Purged, RemovalKind, Removed
from shard_server.domain.messages import DeliveryState
from shard_server.domain.store import ShardStore
from shard_server.domain.transitions import Action, require_transition


def expire_messages(store: ShardStore, context: ShardContext, *, now_ms: int, limit: int) -> int:
    """Remove up to `limit` messages older than the retention period; journaled, counted."""
    cutoff = now_ms - context.config.retention_ms
    expired = 0
    for seq, sent_at in store.oldest_messages(after_seq=0, limit=limit):
        # Seqs are assigned in send order with a non-decreasing clock, so the
        # first message young enough to keep ends the scan.
        if sent_at > cutoff:
            break
        delivery = store.get_delivery(seq)
        if delivery is None:
            continue
        require_transition(delivery.state, Action.EXPIRE)
        commit_event(store, context, Removed(RemovalKind.EXPIRED, seq, sent_at), now_ms=now_ms)
        expired += 1
    return expired


def prune_dedup(store: ShardStore, context: ShardContext, *, now_ms: int) -> None:
    commit_event(store, context, DedupPruned(now_ms), now_ms=now_ms)


def purge(store: ShardStore, context: ShardContext, *, now_ms: int) -> int:
    count = store.message_count()
    if count:
        commit_event(store, context, Purged(store.last_seq(), count), now_ms=now_ms)
    return count


def complete_dead_letters(store: ShardStore, context: ShardContext, seqs: Iterable[int], *, now_ms: int) -> int:
    """The dead-letter queue acknowledged these messages: remove them here."""
    done = 0
    for seq in seqs:
        delivery = store.get_delivery(seq)
        if delivery is None or delivery.state != DeliveryState.DEAD_LETTER_PENDING:
            continue
        require_transition(delivery.state, Action.DEAD_LETTER_DELIVERED)
        commit_event(
            store, context, Removed(RemovalKind.DEAD_LETTER_DELIVERED, seq, delivery.sent_at_ms), now_ms=now_ms
        )
        done += 1
    return done
