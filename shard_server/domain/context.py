"""The fixed facts a decision needs about its shard, and how a decision takes effect."""

from __future__ import annotations

import dataclasses

from shard_server.domain.applying import apply_event
from shard_server.domain.events import DeliveryChanged, Event
from shard_server.domain.messages import Delivery
from shard_server.domain.store import ShardStore
from shardq.queues import QueueConfig
from shardq.receipts import queue_fingerprint


@dataclasses.dataclass(frozen=True, slots=True)
class ShardContext:
    config: QueueConfig
    shard: int
    # The leader's fencing token: stamped on log entries and receipts.
    epoch: int
    # The queue's receipt fingerprint, computed once: every claim and every
    # receipt check needs it.
    fingerprint: int = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", queue_fingerprint(self.config.name))


def commit_event(
    store: ShardStore, context: ShardContext, event: Event, *, now_ms: int, current: Delivery | None = None
) -> None:
    """Journal the event and apply it, in the caller's transaction.

    `current`: the delivery state the decision was based on, saving a re-read.
    """
    if current is not None and type(event) is DeliveryChanged:
        # What apply_event does for it, in one store call (hot path: every claim).
        store.record_delivery_change(event, previous=current)
        return
    store.record_event(event)
    apply_event(store, event, fifo=context.config.fifo, now_ms=now_ms, current=current)
