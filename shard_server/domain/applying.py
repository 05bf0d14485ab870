"""Applying log events to a store: deterministic, no decisions.

Leaders call this right after deciding an event; followers call it for every
event of a replicated log entry. The FIFO rule "only a group's head is in the
delivery index" is maintained here, so both sides keep it identically.
"""

from __future__ import annotations

import dataclasses

from shard_server.domain.events import (
    DedupPruned,
    DeliveryChanged,
    Event,
    Purged,
    Removed,
    Sent,
)
from shard_server.domain.messages import Delivery, DeliveryState
from shard_server.domain.store import ShardStore


def apply_event(store: ShardStore, event: Event, *, fifo: bool, now_ms: int, current: Delivery | None = None) -> None:
    """Apply one event. `current` is the message's stored delivery state when the
    caller (a leader that just decided the event) already read it; followers omit it."""
    if isinstance(event, Sent):
        _apply_sent(store, event, fifo=fifo)
    elif isinstance(event, DeliveryChanged):
        previous = current if current is not None else store.get_delivery(event.delivery.seq)
        store.put_delivery(event.delivery, previous=previous)
    elif isinstance(event, Removed):
        _apply_removed(store, event, fifo=fifo, now_ms=now_ms, current=current)
    elif isinstance(event, Purged):
        store.clear_messages()
    elif isinstance(event, DedupPruned):
        store.prune_dedup(up_to_ms=event.up_to_ms)
    else:  # pragma: no cover - exhaustive over Event
        raise TypeError(f"unknown event {event!r}")


def _apply_sent(store: ShardStore, event: Sent, *, fifo: bool) -> None:
    record = event.record
    delivery = event.delivery
    if fifo and record.group_id:
        head = store.first_group_member(record.group_id)
        store.add_group_member(record.group_id, record.seq)
        if head is not None:
            delivery = dataclasses.replace(delivery, state=DeliveryState.WAITING_IN_GROUP)
    store.put_record(record)
    store.put_delivery(delivery, previous=None)
    if event.dedup_expires_at_ms:
        store.put_dedup(
            record.dedup_id, seq=record.seq, sent_at_ms=record.sent_at_ms, expires_at_ms=event.dedup_expires_at_ms
        )
    store.set_last_seq(max(store.last_seq(), record.seq))


def _apply_removed(store: ShardStore, event: Removed, *, fifo: bool, now_ms: int, current: Delivery | None) -> None:
    delivery = current if current is not None else store.get_delivery(event.seq)
    if delivery is None:
        return
    group_id = ""
    if fifo:
        record = store.get_record(event.seq)
        group_id = record.group_id if record is not None else ""
    store.delete_delivery(delivery)
    store.delete_record(event.seq)
    if not group_id:
        return
    store.remove_group_member(group_id, event.seq)
    if delivery.state == DeliveryState.WAITING_IN_GROUP:
        return  # expired from behind the head: the head is unchanged
    promoted = store.first_group_member(group_id)
    if promoted is None:
        return
    waiting = store.get_delivery(promoted)
    if waiting is not None and waiting.state == DeliveryState.WAITING_IN_GROUP:
        # The next message keeps its own delay but never becomes visible in the past.
        visible_at = max(waiting.visible_at_ms, now_ms)
        store.put_delivery(
            dataclasses.replace(waiting, state=DeliveryState.READY, visible_at_ms=visible_at), previous=waiting
        )
