"""Acting on a receipt: delete, change visibility, release (nack with backoff), dead-letter now.

Each succeeds only with the message's current claim before its deadline; any
other receipt is rejected with a specific reason and changes nothing.
"""

from __future__ import annotations

import dataclasses

from shard_server.domain.context import ShardContext, commit_event
from shard_server.domain.events import ChangeKind, DeliveryChanged, RemovalKind, Removed
from shard_server.domain.messages import Delivery, DeliveryState
from shard_server.domain.receiving import DEAD_LETTER_REASON_REJECTED, ClaimedMessage
from shard_server.domain.store import ShardStore
from shard_server.domain.transitions import Action, next_state, require_transition
from shardq.errors import Reason
from shardq.receipts import Receipt


def check_receipt(store: ShardStore, context: ShardContext, receipt: Receipt, *, now_ms: int) -> Delivery | Reason:
    """The message's delivery state if the receipt holds its live claim, else why not."""
    if receipt.queue_fingerprint != context.fingerprint or receipt.shard != context.shard:
        return Reason.WRONG_QUEUE
    delivery = store.get_delivery(receipt.seq)
    if delivery is None:
        return Reason.MESSAGE_NOT_FOUND
    if (
        delivery.state != DeliveryState.CLAIMED
        or delivery.claim_epoch != receipt.epoch
        or delivery.claim_token != receipt.claim_token
    ):
        return Reason.STALE_RECEIPT
    if delivery.visible_at_ms <= now_ms:
        return Reason.RECEIPT_EXPIRED
    return delivery


def delete_message(store: ShardStore, context: ShardContext, receipt: Receipt, *, now_ms: int) -> Reason | None:
    checked = check_receipt(store, context, receipt, now_ms=now_ms)
    if isinstance(checked, Reason):
        return checked
    require_transition(checked.state, Action.DELETE)
    event = Removed(RemovalKind.DELETED, checked.seq, checked.sent_at_ms)
    commit_event(store, context, event, now_ms=now_ms, current=checked)
    return None


def delete_claimed(store: ShardStore, context: ShardContext, claimed: list[ClaimedMessage], *, now_ms: int) -> None:
    """Delete messages claimed in this same transaction (a receive that deletes what it
    receives): their claims are live by construction, so no receipt is checked."""
    for message in claimed:
        require_transition(message.delivery.state, Action.DELETE)
        event = Removed(RemovalKind.DELETED, message.record.seq, message.delivery.sent_at_ms)
        commit_event(store, context, event, now_ms=now_ms, current=message.delivery)


def change_visibility(
    store: ShardStore, context: ShardContext, receipt: Receipt, *, visibility_timeout_ms: int, now_ms: int
) -> Reason | None:
    checked = check_receipt(store, context, receipt, now_ms=now_ms)
    if isinstance(checked, Reason):
        return checked
    changed = dataclasses.replace(
        checked,
        state=next_state(checked.state, Action.CHANGE_VISIBILITY),
        visible_at_ms=now_ms + visibility_timeout_ms,
    )
    event = DeliveryChanged(ChangeKind.VISIBILITY_CHANGED, changed)
    commit_event(store, context, event, now_ms=now_ms, current=checked)
    return None


def compute_release_backoff_ms(context: ShardContext, receive_count: int) -> int:
    """Exponential: base, 2*base, 4*base ... capped at the queue's maximum."""
    config = context.config
    exponent = max(receive_count - 1, 0)
    if exponent >= 62:
        return config.nack_backoff_max_ms
    return min(config.nack_backoff_base_ms << exponent, config.nack_backoff_max_ms)


def release_message(
    store: ShardStore, context: ShardContext, receipt: Receipt, *, now_ms: int, reason: str = ""
) -> Reason | None:
    """Release with backoff; `reason` (why the handler gave up) is kept as the message's
    last error, until a later release says otherwise."""
    checked = check_receipt(store, context, receipt, now_ms=now_ms)
    if isinstance(checked, Reason):
        return checked
    released = dataclasses.replace(
        checked,
        state=next_state(checked.state, Action.RELEASE),
        visible_at_ms=now_ms + compute_release_backoff_ms(context, checked.receive_count),
        last_error=reason or checked.last_error,
    )
    event = DeliveryChanged(ChangeKind.RELEASED, released, reason=reason)
    commit_event(store, context, event, now_ms=now_ms, current=checked)
    return None


def dead_letter_message(
    store: ShardStore, context: ShardContext, receipt: Receipt, *, now_ms: int, reason: str = ""
) -> Reason | None:
    """Dead-letter the claimed message now, whatever its receive count (its consumer knows
    it will never succeed); the dead-letter mover takes it to the queue's DLQ as it takes
    one received too often. `reason` is kept as its last error, and so carried along.
    Only for a queue with a dead-letter queue: the caller checks."""
    checked = check_receipt(store, context, receipt, now_ms=now_ms)
    if isinstance(checked, Reason):
        return checked
    dead = dataclasses.replace(
        checked, state=next_state(checked.state, Action.DEAD_LETTER), last_error=reason or checked.last_error
    )
    event = DeliveryChanged(ChangeKind.DEAD_LETTERED, dead, DEAD_LETTER_REASON_REJECTED)
    commit_event(store, context, event, now_ms=now_ms, current=checked)
    return None
