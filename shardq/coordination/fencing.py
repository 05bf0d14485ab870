"""Pure fencing rules over lease records: expiry, takeover, renewal, ISR, and when to stop serving.

Clocks: `now_ms` is wall-clock time (what others compare a lease's renew time with);
monotonic times only ever meet the same process's monotonic clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardq.coordination.leases import INCARNATIONS_ANNOTATION, ISR_ANNOTATION, QUEUE_UID_ANNOTATION, LeaseRecord

_ISR_SEPARATOR = ","


def is_expired(record: LeaseRecord, now_ms: int) -> bool:
    """True when the lease protects nobody at `now_ms`: it has no holder, or its holder
    has not renewed within `duration_ms`.

    The lease still holds at renew + duration - 1 and is gone at renew + duration
    (client-go's leader election draws the same line).
    """
    if not record.holder:
        return True
    return now_ms >= record.renew_time_ms + record.duration_ms


def build_takeover(record: LeaseRecord, *, new_holder: str, now_ms: int, duration_ms: int) -> LeaseRecord:
    """The lease acquired by `new_holder`, in a new epoch.

    Every acquisition opens a new epoch, also when `new_holder` held the lease before:
    a restarted server keeps its name (a StatefulSet pod's, or a local server's) but has
    lost whatever it had answered and not replicated, and receipts from its previous term
    must not match claims in the next one. Client-go counts only holder changes; our
    `transitions` is a fencing token, so it counts terms. Whether the lease may be taken
    (expired, or handed over) is the caller's decision; the store's compare-and-swap
    makes sure the decision was taken on the latest version.
    """
    if not new_holder:
        raise ValueError("a takeover needs a holder")
    if duration_ms <= 0:
        raise ValueError(f"duration_ms must be positive, got {duration_ms}")
    return dataclasses.replace(
        record,
        holder=new_holder,
        acquire_time_ms=now_ms,
        renew_time_ms=now_ms,
        duration_ms=duration_ms,
        transitions=record.transitions + 1,
        annotations=dict(record.annotations),
    )


# A Kubernetes Lease counts its transitions in an int32: no epoch may pass this.
EPOCH_LIMIT = 2**31 - 1


def build_epoch_raise(record: LeaseRecord, *, above: int, now_ms: int) -> LeaseRecord:
    """The lease kept by its holder in a new epoch above `above`, an epoch some replica
    of the shard has seen although the lease never reached it: the Leases were made
    anew (deleted by hand, or restored) while the volumes kept data of later epochs.
    Leading below that epoch, or at it beside its other leader, would make the new
    term's entries match the old term's by index and epoch. A new epoch above every
    one seen is a new term of its own, like a takeover by the holder itself."""
    if not record.holder:
        raise ValueError(f"lease {record.name!r} has no holder to raise its epoch")
    if above < record.transitions:
        raise ValueError(f"epoch {above} is below the lease's {record.transitions}: nothing to raise")
    if above >= EPOCH_LIMIT:
        raise ValueError(f"epoch {above} leaves no room below the limit {EPOCH_LIMIT}")
    return dataclasses.replace(
        record,
        acquire_time_ms=now_ms,
        renew_time_ms=now_ms,
        transitions=above + 1,
        annotations=dict(record.annotations),
    )


def build_renewal(record: LeaseRecord, *, now_ms: int) -> LeaseRecord:
    """The lease renewed by its holder at `now_ms`: same holder, same epoch.

    Read the monotonic clock for `safe_serving_deadline_ms` *before* reading the wall
    clock for `now_ms`: then the renew time others see is no earlier than the moment the
    holder's own deadline is counted from.
    """
    if not record.holder:
        raise ValueError(f"lease {record.name!r} has no holder to renew it")
    return dataclasses.replace(record, renew_time_ms=now_ms, annotations=dict(record.annotations))


def build_isr_change(record: LeaseRecord, isr: Iterable[str]) -> LeaseRecord:
    """The lease with `isr` as its in-sync replica set (stored sorted, so equal sets are equal text)."""
    members = frozenset(isr)
    for member in members:
        if not member or _ISR_SEPARATOR in member or member != member.strip():
            raise ValueError(f"invalid replica name in ISR: {member!r}")
    # The leader's own log is the reference: it cannot be out of sync with itself, and an
    # ISR without the leader would let a promotion skip the only complete copy.
    if record.holder and record.holder not in members:
        raise ValueError(f"the ISR {sorted(members)} must contain the leader {record.holder!r}")
    annotations = dict(record.annotations)
    annotations[ISR_ANNOTATION] = _ISR_SEPARATOR.join(sorted(members))
    return dataclasses.replace(record, annotations=annotations)


def isr_of(record: LeaseRecord) -> frozenset[str]:
    """The in-sync replica set recorded on the lease; empty when none was recorded."""
    text = record.annotations.get(ISR_ANNOTATION, "")
    return frozenset(name for name in text.split(_ISR_SEPARATOR) if name)


def incarnations_of(record: LeaseRecord) -> dict[str, str]:
    """The data incarnation the ISR vouches for, per replica (empty when not recorded)."""
    text = record.annotations.get(INCARNATIONS_ANNOTATION, "")
    pairs = (item.partition("=") for item in text.split(_ISR_SEPARATOR) if item)
    return {name: incarnation for name, _, incarnation in pairs if name and incarnation}


def build_incarnations(record: LeaseRecord, incarnations: dict[str, str]) -> LeaseRecord:
    """The lease recording which copy of each replica its ISR means."""
    annotations = dict(record.annotations)
    annotations[INCARNATIONS_ANNOTATION] = _ISR_SEPARATOR.join(f"{k}={v}" for k, v in sorted(incarnations.items()))
    return dataclasses.replace(record, annotations=annotations)


def build_queue_uid(record: LeaseRecord, uid: str) -> LeaseRecord:
    """The lease naming creation `uid` of its queue ("" names none)."""
    annotations = {key: value for key, value in record.annotations.items() if key != QUEUE_UID_ANNOTATION}
    if uid:
        annotations[QUEUE_UID_ANNOTATION] = uid
    return dataclasses.replace(record, annotations=annotations)


def for_another_creation(record: LeaseRecord, uid: str) -> bool:
    """Whether the lease is for another creation of the queue than `uid` (both named)."""
    named = record.annotations.get(QUEUE_UID_ANNOTATION, "")
    return bool(named and uid and named != uid)


def build_abdication(record: LeaseRecord, *, leaving: str) -> LeaseRecord:
    """The lease given up by a holder whose data the ISR does not vouch for: no holder,
    and the holder out of the ISR, so the next takeover picks a replica that has the data."""
    annotations = dict(record.annotations)
    annotations[ISR_ANNOTATION] = _ISR_SEPARATOR.join(sorted(isr_of(record) - {leaving}))
    return dataclasses.replace(record, holder="", annotations=annotations)


def safe_serving_deadline_ms(renew_started_monotonic_ms: int, *, duration_ms: int, clock_skew_margin_ms: int) -> int:
    """The monotonic time at which a leader must have stopped serving, after a renewal
    that was *sent* at `renew_started_monotonic_ms` and succeeded.

    Counting from the start of the request, not from the answer, keeps the deadline
    before anyone else can see the lease expire however long the request took: the
    renew time it wrote was read after that start. The margin covers the wall-clock
    skew between this server and whoever judges expiry, plus the time it takes to stop.
    A failed renewal moves nothing: the previous deadline still stands.
    """
    if duration_ms <= 0:
        raise ValueError(f"duration_ms must be positive, got {duration_ms}")
    if not 0 <= clock_skew_margin_ms < duration_ms:
        raise ValueError(f"clock_skew_margin_ms must be in [0, {duration_ms}), got {clock_skew_margin_ms}")
    return renew_started_monotonic_ms + duration_ms - clock_skew_margin_ms
