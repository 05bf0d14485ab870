"""Claiming messages for a receiver, and dead-lettering on the way.

A claim moves the message's deadline to now + visibility timeout and bumps its
claim token; the receipt names (epoch, token), so only the newest claim can
delete or extend it (invariants 1 and 2).
"""

from __future__ import annotations

import dataclasses

from shard_server.domain.context import ShardContext, commit_event
from shard_server.domain.events import ChangeKind, DeliveryChanged
from shard_server.domain.messages import Delivery, MessageRecord
from shard_server.domain.store import ShardStore
from shard_server.domain.transitions import Action, next_state
from shardq.receipts import Receipt

DEAD_LETTER_REASON_MAX_RECEIVES = "max_receive_count"


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class ClaimedMessage:
    record: MessageRecord
    delivery: Delivery
    receipt: Receipt


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveOutcome:
    claimed: list[ClaimedMessage]
    dead_lettered: int


def receive_messages(
    store: ShardStore, context: ShardContext, *, max_messages: int, visibility_timeout_ms: int, now_ms: int
) -> ReceiveOutcome:
    claimed: list[ClaimedMessage] = []
    dead_lettered = 0
    seen: set[int] = set()
    after: tuple[int, int] | None = None
    max_receives = context.config.max_receive_count
    while len(claimed) < max_messages:
        wanted = max_messages - len(claimed)
        candidates = store.eligible(now_ms, after=after, limit=wanted)
        if not candidates:
            break
        for key in candidates:
            after = key
            seq = key[1]
            if seq in seen:
                continue  # a zero visibility timeout makes a fresh claim eligible at once
            seen.add(seq)
            delivery = store.get_delivery(seq)
            if delivery is None:
                continue
            if max_receives and delivery.receive_count >= max_receives:
                dead = dataclasses.replace(delivery, state=next_state(delivery.state, Action.DEAD_LETTER))
                event = DeliveryChanged(ChangeKind.DEAD_LETTERED, dead, DEAD_LETTER_REASON_MAX_RECEIVES)
                commit_event(store, context, event, now_ms=now_ms, current=delivery)
                dead_lettered += 1
                continue
            record = store.get_record(seq)
            if record is None:
                continue
            # Built directly rather than with dataclasses.replace: this is the hot path.
            claim = Delivery(
                seq,
                next_state(delivery.state, Action.CLAIM),
                delivery.sent_at_ms,
                now_ms + visibility_timeout_ms,
                delivery.receive_count + 1,
                delivery.first_received_at_ms or now_ms,
                now_ms,
                context.epoch,
                delivery.claim_token + 1,
            )
            event = DeliveryChanged(ChangeKind.RECEIVED, claim)
            commit_event(store, context, event, now_ms=now_ms, current=delivery)
            receipt = Receipt(context.fingerprint, context.shard, seq, context.epoch, claim.claim_token)
            claimed.append(ClaimedMessage(record, claim, receipt))
    return ReceiveOutcome(claimed, dead_lettered)
