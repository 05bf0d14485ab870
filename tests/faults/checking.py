"""A pure checker: a recorded history plus the final stored state in, violations out.

Soundness first: every rule below flags only what no correct execution can
produce, whatever the interleaving of concurrent operations. The reasoning
each rule relies on:

- An operation takes effect at one instant between its invocation and its
  completion (for an UNKNOWN operation: after its invocation, or never). So
  "A completed before B was invoked" (monotonic clock, `complete_ns <
  invoke_ns`) means A's effect precedes B's. Overlapping operations are never
  ordered by a rule.
- The server's clock and the clients' wall clocks are the same machine clock,
  so a server decision made during an operation happened at a wall time in
  [invoke_wall_ms, complete_wall_ms]; `tolerance_ms` absorbs clock reads
  rounded to milliseconds and the like.
- A receive may answer before its claim commits (DESIGN §5): a claim answered by
  a leader that then lost it never took effect, and its holder's lease was never
  real. Worse, a deposed leader that has not noticed yet may answer from its older
  state (a stale read; at-least-once allows the redelivery, and the receipt is
  then refused). A delivery is *confirmed* when its receipt was accepted by an OK
  delete or change-visibility: only then did its claim certainly commit. Every rule
  that takes a receive as evidence of the queue's state uses confirmed deliveries.

The rules, by the property of issue 4 they prove:

1. Nothing acknowledged is lost. For every message id returned by an OK send:
   `lost-never-received` — never in an OK receive, not stored at the end, and not
   found in the queue's dead-letter queue; `lost-after-receive` — received, but
   not stored at the end, never the target of a delete that was OK or UNKNOWN,
   and not dead-lettered. Identity: `phantom` — a received body no send ever
   carried; for a body sent by exactly one send call, acknowledged as id X but
   received as id Y: `stored-twice` when X was also received or is stored (one
   send call created two messages, e.g. a library retry of a send whose first
   attempt was applied after all), else `wrong-message-id`.
2. Receipts are current. An OK delete or change-visibility X using the receipt
   of delivery d (from receive Ra):
   `stale-receipt` — a confirmed delivery of the same message by another receive
   Rb that was invoked after Ra completed and completed before X was invoked:
   Rb's committed claim replaced Ra's before X was decided;
   `expired-receipt` — X was invoked more than `tolerance_ms` after the latest
   deadline d could have had: max(d.visible_until_ms, complete_wall_ms +
   timeout of every OK or UNKNOWN change-visibility on the same receipt that was
   invoked before X completed).
3. One holder. A lease of delivery d is surely valid from its receive's
   complete_wall_ms until the earliest end it could have had: min(
   d.visible_until_ms, invoke_wall_ms + timeout of any OK/UNKNOWN change-visibility
   on its receipt, invoke_wall_ms of any OK/UNKNOWN delete of it).
   `two-holders` — two confirmed leases of one message overlap by more than
   `tolerance_ms`.
4. No write from a fenced leader, by its symptoms:
   `deleted-twice` — two OK deletes of one message;
   `delivered-after-delete` — a confirmed delivery by a receive invoked after an
   OK delete of the message completed;
   `deleted-but-stored` — an OK-deleted message is stored at the end;
   `epoch-went-back` — a confirmed delivery whose receipt has a lower epoch than
   a delivery of the same shard by a receive that completed before this receive
   was invoked: a claim decided by a superseded leader committed.
5. Dedup and FIFO order.
   `dedup-split` — OK sends with one (queue, group id, dedup id) returned
   different message ids (the workload reuses a dedup id only within its group,
   which keeps it in one dedup scope on FIFO queues too);
   `fifo-order` — in a FIFO group, message A was created by an OK send that
   completed before the OK send creating B was invoked, yet B was delivered
   (an OK receive completed) before any delete of A (OK or UNKNOWN) had been
   invoked: only a group's head is deliverable, and a head leaves only by
   delete (queues with a dead-letter queue skip pairs whose A was dead-lettered).
   Stale reads cannot trip it: any state a leader ever had, however old, had A
   removed only after some delete of A had been invoked;
   `group-two-in-flight` — confirmed leases of two different messages of one
   FIFO group overlap by more than `tolerance_ms`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
from collections.abc import Iterable, Sequence

from tests.faults.history import (
    AnyOperation,
    ChangeVisibility,
    Delete,
    Delivery,
    Operation,
    Receive,
    Send,
    Status,
    StoredMessage,
)

DEFAULT_TOLERANCE_MS = 25


class Property(enum.IntEnum):
    NOTHING_LOST = 1
    RECEIPTS_CURRENT = 2
    ONE_HOLDER = 3
    NO_FENCED_WRITES = 4
    DEDUP_AND_ORDER = 5


@dataclasses.dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    fifo: bool = False
    dead_letter_queue: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    property: Property
    rule: str
    queue: str
    message_id: str
    explanation: str
    op_ids: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"property {int(self.property)} [{self.rule}] {self.queue}/{self.message_id}: {self.explanation}"


MessageKey = tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class _Held:
    """One delivery of one message, with what later happened to its receipt."""

    receive: Receive
    delivery: Delivery
    start_wall_ms: int
    surely_until_wall_ms: int
    confirmed: bool


def describe(operation: Operation) -> str:
    kind = type(operation).__name__
    outcome = operation.status.value + (f" {operation.error}" if operation.error else "")
    return (
        f"op#{operation.op_id} {operation.client} {kind} "
        f"[wall {operation.invoke_wall_ms}..{operation.complete_wall_ms}] {outcome}"
    )


class _Index:
    def __init__(self, operations: Iterable[AnyOperation], final: Sequence[StoredMessage]) -> None:
        self.sends: list[Send] = []
        self.receives: list[Receive] = []
        self.deliveries: dict[MessageKey, list[tuple[Receive, Delivery]]] = collections.defaultdict(list)
        self.by_receipt: dict[str, tuple[Receive, Delivery]] = {}
        self.deletes: dict[MessageKey, list[Delete]] = collections.defaultdict(list)
        self.deletes_by_receipt: dict[str, list[Delete]] = collections.defaultdict(list)
        self.changes_by_receipt: dict[str, list[ChangeVisibility]] = collections.defaultdict(list)
        self.acknowledgements: list[Delete | ChangeVisibility] = []
        for operation in sorted(operations, key=lambda o: o.op_id):
            if isinstance(operation, Send):
                self.sends.append(operation)
            elif isinstance(operation, Receive):
                self.receives.append(operation)
                if operation.ok:
                    for delivery in operation.deliveries:
                        self.deliveries[(operation.queue, delivery.message_id)].append((operation, delivery))
                        self.by_receipt[delivery.receipt] = (operation, delivery)
            elif isinstance(operation, Delete):
                self.acknowledgements.append(operation)
            else:
                self.acknowledgements.append(operation)
        for acknowledgement in self.acknowledgements:
            key = self.key_of(acknowledgement)
            if isinstance(acknowledgement, Delete):
                self.deletes[key].append(acknowledgement)
                self.deletes_by_receipt[acknowledgement.receipt].append(acknowledgement)
            else:
                self.changes_by_receipt[acknowledgement.receipt].append(acknowledgement)
        self.stored: set[MessageKey] = {(m.queue, m.message_id) for m in final}
        # (queue, body) of everything stored at the end or ever received: where dead-letter copies show up.
        self.seen_bodies: set[tuple[str, str]] = {(m.queue, m.body) for m in final}
        for (queue, _), pairs in self.deliveries.items():
            self.seen_bodies.update((queue, delivery.body) for _, delivery in pairs)

    def key_of(self, acknowledgement: Delete | ChangeVisibility) -> MessageKey:
        """The message a receipt names: from the delivery that issued it, else as the client recorded."""
        issued = self.by_receipt.get(acknowledgement.receipt)
        if issued is not None:
            return (issued[0].queue, issued[1].message_id)
        return (acknowledgement.queue, acknowledgement.message_id)

    def confirmed(self, receipt: str) -> bool:
        """True if an OK delete or change-visibility accepted `receipt`: its claim committed."""
        return any(d.ok for d in self.deletes_by_receipt.get(receipt, ())) or any(
            c.ok for c in self.changes_by_receipt.get(receipt, ())
        )

    def held(self, receive: Receive, delivery: Delivery) -> _Held:
        end = delivery.visible_until_ms
        confirmed = False
        for change in self.changes_by_receipt.get(delivery.receipt, ()):
            if change.status is not Status.FAILED:
                end = min(end, change.invoke_wall_ms + change.visibility_timeout_ms)
            confirmed |= change.ok
        for delete in self.deletes_by_receipt.get(delivery.receipt, ()):
            if delete.status is not Status.FAILED:
                end = min(end, delete.invoke_wall_ms)
            confirmed |= delete.ok
        return _Held(receive, delivery, receive.complete_wall_ms, end, confirmed)


def check_history(
    operations: Iterable[AnyOperation],
    *,
    final: Sequence[StoredMessage],
    queues: Sequence[QueueSpec],
    tolerance_ms: int = DEFAULT_TOLERANCE_MS,
) -> list[Violation]:
    """Every violation of properties 1-5 (module docstring) that the history proves."""
    index = _Index(operations, final)
    specs = {spec.name: spec for spec in queues}
    violations: list[Violation] = []
    violations += _check_nothing_lost(index, specs)
    violations += _check_receipts_current(index, tolerance_ms)
    violations += _check_one_holder(index, tolerance_ms)
    violations += _check_no_fenced_writes(index)
    violations += _check_dedup(index)
    violations += _check_fifo(index, specs, tolerance_ms)
    return violations


def format_violations(violations: Sequence[Violation], *, limit: int = 40) -> str:
    lines = [str(v) for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more")
    counts = collections.Counter(f"{int(v.property)}/{v.rule}" for v in violations)
    lines.append("by rule: " + ", ".join(f"{rule}: {n}" for rule, n in sorted(counts.items())))
    return "\n".join(lines)


# -- property 1 -----------------------------------------------------------------------------


def _dead_lettered(index: _Index, specs: dict[str, QueueSpec], queue: str, body: str) -> bool:
    spec = specs.get(queue)
    return spec is not None and bool(spec.dead_letter_queue) and (spec.dead_letter_queue, body) in index.seen_bodies


def _check_nothing_lost(index: _Index, specs: dict[str, QueueSpec]) -> list[Violation]:
    violations: list[Violation] = []
    acknowledged: dict[MessageKey, Send] = {}
    for send in index.sends:
        if send.ok:
            acknowledged.setdefault((send.queue, send.message_id), send)
    for key, send in acknowledged.items():
        queue, message_id = key
        received = index.deliveries.get(key, [])
        if key in index.stored:
            continue
        removed = [d for d in index.deletes.get(key, []) if d.status is not Status.FAILED]
        if removed:
            continue
        if _dead_lettered(index, specs, queue, send.body):
            continue
        if not received:
            violations.append(
                Violation(
                    Property.NOTHING_LOST,
                    "lost-never-received",
                    queue,
                    message_id,
                    f"send {send.body!r} was acknowledged ({describe(send)}) but the message was never "
                    "received and is not stored at the end",
                    (send.op_id,),
                )
            )
        else:
            last = max(received, key=lambda pair: pair[0].complete_ns)[0]
            violations.append(
                Violation(
                    Property.NOTHING_LOST,
                    "lost-after-receive",
                    queue,
                    message_id,
                    f"send {send.body!r} was acknowledged ({describe(send)}) and received {len(received)} time(s) "
                    f"(last {describe(last)}), but no delete of it was acknowledged or left unknown, and it is "
                    "not stored at the end",
                    (send.op_id, last.op_id),
                )
            )
    # Identity: every received body was sent, under the id its one send was given.
    sends_by_body: dict[tuple[str, str], list[Send]] = collections.defaultdict(list)
    for send in index.sends:
        sends_by_body[(send.queue, send.body)].append(send)
    for (queue, message_id), pairs in index.deliveries.items():
        for receive, delivery in pairs:
            sends = sends_by_body.get((queue, delivery.body), [])
            if not sends and not _is_dead_letter_copy(specs, queue, sends_by_body, delivery.body):
                violations.append(
                    Violation(
                        Property.NOTHING_LOST,
                        "phantom",
                        queue,
                        message_id,
                        f"{describe(receive)} returned body {delivery.body!r}, which no send carried",
                        (receive.op_id,),
                    )
                )
                break
            if len(sends) == 1 and sends[0].ok and sends[0].message_id != message_id:
                acknowledged_id = sends[0].message_id
                also_kept = (queue, acknowledged_id) in index.deliveries or (queue, acknowledged_id) in index.stored
                violations.append(
                    Violation(
                        Property.NOTHING_LOST,
                        "stored-twice" if also_kept else "wrong-message-id",
                        queue,
                        message_id,
                        f"body {delivery.body!r} was sent by one call and acknowledged as {acknowledged_id} "
                        f"({describe(sends[0])}) but {describe(receive)} returned it as {message_id}"
                        + (f" while {acknowledged_id} exists too" if also_kept else ""),
                        (sends[0].op_id, receive.op_id),
                    )
                )
                break
    return violations


def _is_dead_letter_copy(
    specs: dict[str, QueueSpec], queue: str, sends_by_body: dict[tuple[str, str], list[Send]], body: str
) -> bool:
    return any(spec.dead_letter_queue == queue and (spec.name, body) in sends_by_body for spec in specs.values())


# -- property 2 -----------------------------------------------------------------------------


def _check_receipts_current(index: _Index, tolerance_ms: int) -> list[Violation]:
    violations: list[Violation] = []
    for acknowledgement in index.acknowledgements:
        if not acknowledgement.ok:
            continue
        issued = index.by_receipt.get(acknowledgement.receipt)
        if issued is None:
            continue
        receive_a, delivery_a = issued
        key = (receive_a.queue, delivery_a.message_id)
        verb = "delete" if isinstance(acknowledgement, Delete) else "change-visibility"
        for receive_b, delivery_b in index.deliveries.get(key, []):
            if receive_b is receive_a or delivery_b.receipt == delivery_a.receipt:
                continue
            if not index.confirmed(delivery_b.receipt):
                continue
            if receive_a.complete_ns < receive_b.invoke_ns and receive_b.complete_ns < acknowledgement.invoke_ns:
                violations.append(
                    Violation(
                        Property.RECEIPTS_CURRENT,
                        "stale-receipt",
                        key[0],
                        key[1],
                        f"{verb} {describe(acknowledgement)} succeeded with the receipt of {describe(receive_a)} "
                        f"(epoch {delivery_a.epoch}, claim {delivery_a.claim_token}), although "
                        f"{describe(receive_b)} claimed the message again (epoch {delivery_b.epoch}, claim "
                        f"{delivery_b.claim_token}) after that receive and before the {verb} was invoked",
                        (receive_a.op_id, receive_b.op_id, acknowledgement.op_id),
                    )
                )
                break
        latest_deadline = delivery_a.visible_until_ms
        extended_by: list[int] = []
        for change in index.changes_by_receipt.get(acknowledgement.receipt, ()):
            if change is acknowledgement or change.status is Status.FAILED:
                continue
            if change.invoke_ns < acknowledgement.complete_ns:
                candidate = change.complete_wall_ms + change.visibility_timeout_ms
                if candidate > latest_deadline:
                    latest_deadline = candidate
                    extended_by.append(change.op_id)
        late_by = acknowledgement.invoke_wall_ms - latest_deadline
        if late_by > tolerance_ms:
            violations.append(
                Violation(
                    Property.RECEIPTS_CURRENT,
                    "expired-receipt",
                    key[0],
                    key[1],
                    f"{verb} {describe(acknowledgement)} succeeded {late_by} ms after the latest possible deadline "
                    f"{latest_deadline} of the receipt from {describe(receive_a)} "
                    f"(visible_until {delivery_a.visible_until_ms}"
                    + (f", extended by ops {extended_by}" if extended_by else "")
                    + ")",
                    (receive_a.op_id, acknowledgement.op_id),
                )
            )
    return violations


# -- property 3 -----------------------------------------------------------------------------


def _overlap_ms(a: _Held, b: _Held) -> int:
    return min(a.surely_until_wall_ms, b.surely_until_wall_ms) - max(a.start_wall_ms, b.start_wall_ms)


def _overlapping_pairs(held: Sequence[_Held], tolerance_ms: int) -> Iterable[tuple[_Held, _Held, int]]:
    confirmed = sorted((h for h in held if h.confirmed), key=lambda h: h.start_wall_ms)
    for i, first in enumerate(confirmed):
        for second in confirmed[i + 1 :]:
            if second.start_wall_ms >= first.surely_until_wall_ms - tolerance_ms:
                break
            overlap = _overlap_ms(first, second)
            if overlap > tolerance_ms:
                yield first, second, overlap


def _describe_lease(lease: _Held) -> str:
    return (
        f"{describe(lease.receive)} (epoch {lease.delivery.epoch}, claim {lease.delivery.claim_token}, "
        f"held surely {lease.start_wall_ms}..{lease.surely_until_wall_ms})"
    )


def _check_one_holder(index: _Index, tolerance_ms: int) -> list[Violation]:
    violations: list[Violation] = []
    for key, pairs in index.deliveries.items():
        held = [index.held(receive, delivery) for receive, delivery in pairs]
        for first, second, overlap in _overlapping_pairs(held, tolerance_ms):
            violations.append(
                Violation(
                    Property.ONE_HOLDER,
                    "two-holders",
                    key[0],
                    key[1],
                    f"confirmed leases overlap by {overlap} ms: {_describe_lease(first)} and {_describe_lease(second)}",
                    (first.receive.op_id, second.receive.op_id),
                )
            )
    return violations


# -- property 4 -----------------------------------------------------------------------------


def _check_no_fenced_writes(index: _Index) -> list[Violation]:
    violations: list[Violation] = []
    for key, deletes in index.deletes.items():
        acknowledged = sorted((d for d in deletes if d.ok), key=lambda d: d.complete_ns)
        if len(acknowledged) > 1:
            violations.append(
                Violation(
                    Property.NO_FENCED_WRITES,
                    "deleted-twice",
                    key[0],
                    key[1],
                    f"{len(acknowledged)} deletes were acknowledged: " + "; ".join(describe(d) for d in acknowledged),
                    tuple(d.op_id for d in acknowledged),
                )
            )
        if not acknowledged:
            continue
        first = acknowledged[0]
        for receive, delivery in index.deliveries.get(key, []):
            if receive.invoke_ns > first.complete_ns and index.confirmed(delivery.receipt):
                violations.append(
                    Violation(
                        Property.NO_FENCED_WRITES,
                        "delivered-after-delete",
                        key[0],
                        key[1],
                        f"{describe(receive)} returned the message (epoch {delivery.epoch}, a receipt later "
                        f"accepted) after {describe(first)} had acknowledged deleting it",
                        (first.op_id, receive.op_id),
                    )
                )
                break
        if key in index.stored:
            violations.append(
                Violation(
                    Property.NO_FENCED_WRITES,
                    "deleted-but-stored",
                    key[0],
                    key[1],
                    f"{describe(first)} acknowledged deleting the message, yet it is stored at the end",
                    (first.op_id,),
                )
            )
    violations += _check_epochs(index)
    return violations


def _check_epochs(index: _Index) -> list[Violation]:
    violations: list[Violation] = []
    observed: dict[tuple[str, int], list[tuple[int, int, Receive]]] = collections.defaultdict(list)
    for receive in index.receives:
        if receive.ok:
            for delivery in receive.deliveries:
                observed[(receive.queue, delivery.shard)].append((receive.complete_ns, delivery.epoch, receive))
    for (queue, shard), observations in observed.items():
        observations.sort(key=lambda o: o[0])
        completions = [o[0] for o in observations]
        # prefix maximum of epochs in completion order, with the receive that showed it
        best: list[tuple[int, Receive]] = []
        for _, epoch, receive in observations:
            best.append((epoch, receive) if not best or epoch > best[-1][0] else best[-1])
        reported: set[int] = set()
        for receive in index.receives:
            if not receive.ok or receive.queue != queue or receive.op_id in reported:
                continue
            position = bisect.bisect_left(completions, receive.invoke_ns)
            if position == 0:
                continue
            highest, shown_by = best[position - 1]
            for delivery in receive.deliveries:
                if delivery.shard == shard and delivery.epoch < highest and index.confirmed(delivery.receipt):
                    reported.add(receive.op_id)
                    violations.append(
                        Violation(
                            Property.NO_FENCED_WRITES,
                            "epoch-went-back",
                            queue,
                            delivery.message_id,
                            f"{describe(receive)} got a receipt of epoch {delivery.epoch} on shard {shard} (later "
                            f"accepted), after {describe(shown_by)} had completed with epoch {highest} on that shard",
                            (shown_by.op_id, receive.op_id),
                        )
                    )
                    break
    return violations


# -- property 5 -----------------------------------------------------------------------------


def _check_dedup(index: _Index) -> list[Violation]:
    violations: list[Violation] = []
    by_dedup: dict[tuple[str, str, str], list[Send]] = collections.defaultdict(list)
    for send in index.sends:
        if send.ok and send.dedup_id:
            by_dedup[(send.queue, send.group_id, send.dedup_id)].append(send)
    for (queue, group_id, dedup_id), sends in by_dedup.items():
        ids = {s.message_id for s in sends}
        if len(ids) > 1:
            violations.append(
                Violation(
                    Property.DEDUP_AND_ORDER,
                    "dedup-split",
                    queue,
                    sends[0].message_id,
                    f"dedup id {dedup_id!r} (group {group_id!r}) was acknowledged with {len(ids)} different "
                    "message ids: " + "; ".join(f"{describe(s)} -> {s.message_id}" for s in sends),
                    tuple(s.op_id for s in sends),
                )
            )
    return violations


def _check_fifo(index: _Index, specs: dict[str, QueueSpec], tolerance_ms: int) -> list[Violation]:
    violations: list[Violation] = []
    fifo_queues = {name for name, spec in specs.items() if spec.fifo}
    created: dict[tuple[str, str], dict[str, Send]] = collections.defaultdict(dict)
    for send in index.sends:
        if send.ok and not send.duplicate and send.queue in fifo_queues:
            group = created[(send.queue, send.group_id)]
            earlier = group.get(send.message_id)
            if earlier is None or send.complete_ns < earlier.complete_ns:
                group[send.message_id] = send
    for (queue, group_id), messages in created.items():
        ordered = sorted(messages.items(), key=lambda item: item[1].complete_ns)
        for message_b, send_b in ordered:
            deliveries_b = index.deliveries.get((queue, message_b), [])
            if not deliveries_b:
                continue
            first_b = min((receive for receive, _ in deliveries_b), key=lambda r: r.complete_ns)
            for message_a, send_a in reversed(ordered):
                if message_a == message_b or not send_a.complete_ns < send_b.invoke_ns:
                    continue
                if _dead_lettered(index, specs, queue, send_a.body):
                    continue
                removals = [
                    d.invoke_ns for d in index.deletes.get((queue, message_a), []) if d.status is not Status.FAILED
                ]
                if removals and min(removals) < first_b.complete_ns:
                    continue
                violations.append(
                    Violation(
                        Property.DEDUP_AND_ORDER,
                        "fifo-order",
                        queue,
                        message_b,
                        f"group {group_id!r}: {send_b.body!r} ({describe(send_b)}) was sent after {send_a.body!r} "
                        f"({describe(send_a)}) but delivered by {describe(first_b)} before any delete of "
                        f"{message_a} was invoked",
                        (send_a.op_id, send_b.op_id, first_b.op_id),
                    )
                )
                break
    # Group membership from the deliveries themselves, so messages created by sends
    # whose outcome is unknown take part too.
    held_by_group: dict[tuple[str, str], list[_Held]] = collections.defaultdict(list)
    for (queue, _), pairs in index.deliveries.items():
        if queue in fifo_queues:
            for receive, delivery in pairs:
                held_by_group[(queue, delivery.group_id)].append(index.held(receive, delivery))
    for (queue, group_id), held in held_by_group.items():
        for first, second, overlap in _overlapping_pairs(held, tolerance_ms):
            if first.delivery.message_id == second.delivery.message_id:
                continue
            violations.append(
                Violation(
                    Property.DEDUP_AND_ORDER,
                    "group-two-in-flight",
                    queue,
                    second.delivery.message_id,
                    f"group {group_id!r}: confirmed leases of two messages overlap by {overlap} ms: "
                    f"{first.delivery.message_id} by {_describe_lease(first)} and "
                    f"{second.delivery.message_id} by {_describe_lease(second)}",
                    (first.receive.op_id, second.receive.op_id),
                )
            )
    return violations
