"""Claiming messages for a receiver, and dead-lettering on the way.

A claim moves the message's deadline to now + visibility timeout and bumps its
claim token; the receipt names (epoch, token), so only the newest claim can
delete or extend it (invariants 1 and 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from shard_server.domain.context import ShardContext, commit_event
from shard_server.domain.events import ChangeKind, DeliveryChanged
from shard_server.domain.messages import Delivery, MessageRecord
from shard_server.domain.store import ShardStore
from shard_server.domain.transitions import Action, next_state
from shardq.receipts import Receipt

DEAD_LETTER_REASON_MAX_RECEIVES = "max_receive_count"
# Dead-lettered by its consumer before that (acknowledging.dead_letter_message).
DEAD_LETTER_REASON_REJECTED = "rejected"
# Read once: an enum member read from its class costs about 60 ns, once per claimed message.
_CLAIM = Action.CLAIM
_RECEIVED = ChangeKind.RECEIVED


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class ClaimedMessage:
    record: MessageRecord
    delivery: Delivery
    receipt: Receipt


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveOutcome:
    claimed: list[ClaimedMessage]
    dead_lettered: int
    # What the claimed messages weigh (message_size), for callers filling a response.
    claimed_bytes: int = 0


# Receives start their claims at the same shard for a while, then at the next: concurrent
# consumers then claim from one shard, and their claims and deletes share its commits
# (each shard is an LMDB environment of its own, so work on four shards costs four
# commits and four fsyncs where work on one costs one). Every shard leads in turn, once
# every CLAIM_ROTATION_MS (up to 400 shards), so none waits long while another has plenty.
CLAIM_ROTATION_MS = 400


def first_shard_to_claim(now_ms: int, shards: int) -> int:
    """Which of `shards` (by position) a receive made at `now_ms` claims from first: each
    in turn, for CLAIM_ROTATION_MS / shards at a time (at least a millisecond, so a
    queue of more shards than that takes a millisecond per shard to go round)."""
    return (now_ms // max(1, CLAIM_ROTATION_MS // shards)) % shards


def newest_seq(outcome: ReceiveOutcome) -> int:
    """The newest message a claim hands out (0 for none): it may answer before its
    commit only if that message's send is durable already."""
    return max((claimed.record.seq for claimed in outcome.claimed), default=0)


def message_size(record: MessageRecord) -> int:
    """About what a message weighs in a response: body, attributes and ids."""
    size = len(record.body) + len(record.group_id) + len(record.dedup_id)
    if record.attributes:
        size += sum(len(key) + len(value) for key, value in record.attributes.items())
    return size


def receive_messages(
    store: ShardStore,
    context: ShardContext,
    *,
    max_messages: int,
    visibility_timeout_ms: int,
    now_ms: int,
    max_bytes: int | None = None,
    strict_bytes: bool = False,
) -> ReceiveOutcome:
    """Claim up to max_messages eligible messages, oldest deadline first; on a queue with
    priority lanes, the higher lanes' first (then the rest, lane 0's among them).

    `max_bytes` bounds what the claimed messages weigh together, so they fit
    one response; the first message is claimed whatever its size, unless
    `strict_bytes` (then a message that does not fit ends the claim).
    """
    claimed: list[ClaimedMessage] = []
    claimed_bytes = 0
    dead_lettered = 0
    seen: set[int] = set()
    max_receives = context.config.max_receive_count
    # The priority index holds only messages above lane 0, which the index holds too: those
    # claimed or dead-lettered from it are `seen` when the index comes to them.
    scans: tuple[Callable[..., Sequence[tuple[int, ...]]], ...] = (
        (store.eligible_by_priority, store.eligible) if context.config.priority_lanes > 1 else (store.eligible,)
    )
    for scan in scans:
        after: tuple[int, ...] | None = None
        while len(claimed) < max_messages:
            wanted = max_messages - len(claimed)
            candidates = scan(now_ms, after=after, limit=wanted)
            if not candidates:
                break
            for key in candidates:
                after = key
                seq = key[-1]
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
                size = message_size(record)
                if max_bytes is not None and (claimed or strict_bytes) and claimed_bytes + size > max_bytes:
                    return ReceiveOutcome(claimed, dead_lettered, claimed_bytes)  # full: it waits for the next receive
                claimed_bytes += size
                # Built directly rather than with dataclasses.replace: this is the hot path.
                claim = Delivery(
                    seq,
                    next_state(delivery.state, _CLAIM),
                    delivery.sent_at_ms,
                    now_ms + visibility_timeout_ms,
                    delivery.receive_count + 1,
                    delivery.first_received_at_ms or now_ms,
                    now_ms,
                    context.epoch,
                    delivery.claim_token + 1,
                    "",  # a new delivery: the last release's reason was the previous one's
                    delivery.priority,
                )
                event = DeliveryChanged(_RECEIVED, claim)
                commit_event(store, context, event, now_ms=now_ms, current=delivery)
                receipt = Receipt(context.fingerprint, context.shard, seq, context.epoch, claim.claim_token)
                claimed.append(ClaimedMessage(record, claim, receipt))
    return ReceiveOutcome(claimed, dead_lettered, claimed_bytes)
