"""Background loops of a server: retention and pruning per shard, the dead-letter
mover per queue, and rate-limited redrive from a dead-letter queue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator, Mapping

from shard_server.domain import housekeeping
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import Delivery, NewMessage, format_message_id
from shard_server.domain.validation import RESERVED_ATTRIBUTE_PREFIX
from shard_server.runtime.committing import wall_clock_ms
from shard_server.runtime.forwarding import LEADER_AWAY_REASONS, shards_away
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.storage.lmdb_store import LmdbShardTransaction
from shardq.coordination.cluster_map import DEFAULT_LEASE_DURATION_MS
from shardq.errors import InvalidArgument, NotLeader, Reason, ShardqError, Unavailable
from shardq.queues import QueueConfig
from shardq.receipts import encode_receipt

log = logging.getLogger(__name__)

HOUSEKEEPING_PERIOD_S = 1.0
EXPIRE_BATCH = 5_000
LOG_PRUNE_BATCH = 10_000
DEAD_LETTER_BATCH = 100
REDRIVE_BATCH = 100
# Long enough that a redrive batch is never redelivered to another consumer
# while it is being copied; released at once if the copy fails.
REDRIVE_CLAIM_MS = 60_000


def build_moved_copy(
    *,
    body: bytes,
    attributes: dict[str, str],
    group_id: str,
    dedup_id: str,
    source: str,
    target: QueueConfig,
    priority: int,
) -> NewMessage:
    """A message moved to another queue (dead-lettering, redrive): visible at once,
    remembering where it came from, deduplicated by an id derived from the original
    so a retried move never makes two copies, grouped by its source queue when
    the target is FIFO and the message had no group, and in its priority lane (or
    the target's highest, when the target has fewer lanes)."""
    return NewMessage(
        body=body,
        attributes=attributes,
        group_id=group_id or (source if target.fifo else ""),
        dedup_id=dedup_id,
        delay_ms=0,
        source_queue=source,
        priority=min(priority, target.priority_lanes - 1),
    )


DEAD_LETTER_SOURCE_ATTRIBUTE = "shardq.dead_letter.source_queue"
DEAD_LETTER_REASON_ATTRIBUTE = "shardq.dead_letter.reason"
LAST_ERROR_ATTRIBUTE = "shardq.dead_letter.last_error"
# The priority a dead letter had in its queue, so a redrive through a DLQ of fewer lanes
# (or none) brings it back in its own lane.
PRIORITY_ATTRIBUTE = "shardq.dead_letter.priority"


def dead_letter_attributes(source: QueueConfig, delivery: Delivery | None) -> dict[str, str]:
    """What a dead-letter copy says about itself: where from, why, and the last error
    its handlers gave when releasing it (reserved keys: senders cannot set them)."""
    receives = delivery.receive_count if delivery is not None else 0
    if delivery is not None and receives < source.max_receive_count:
        # Received too often only at max_receive_count: before that its consumer sent it.
        why = f"rejected by its consumer on receive {receives} (max_receive_count {source.max_receive_count})"
    else:
        why = f"received {receives} times (max_receive_count {source.max_receive_count})"
    attributes = {DEAD_LETTER_SOURCE_ATTRIBUTE: source.name, DEAD_LETTER_REASON_ATTRIBUTE: why}
    if delivery is not None and delivery.last_error:
        attributes[LAST_ERROR_ATTRIBUTE] = delivery.last_error
    if delivery is not None and delivery.priority:
        attributes[PRIORITY_ATTRIBUTE] = str(delivery.priority)
    return attributes


async def keep_shard_tidy(shard: HostedShard) -> None:
    """Retention, dedup pruning and journal pruning, each only when due."""
    while True:
        await asyncio.sleep(HOUSEKEEPING_PERIOD_S)
        if not shard.is_local_leader():
            continue  # only the leader decides; followers replay its log
        try:
            await _tidy_once(shard)
        except Exception:  # a background loop that dies stops retention for good: log, go on
            log.exception("queue %s shard %d: housekeeping failed; retrying", shard.queue.config.name, shard.index)


async def _tidy_once(shard: HostedShard) -> None:
    config = shard.queue.config
    now = wall_clock_ms()
    with shard.environment.read() as tx:
        oldest = tx.oldest_messages(after_seq=0, limit=1)
        expire_due = bool(oldest) and oldest[0][1] <= now - config.retention_ms
        dedup_due = (tx.next_dedup_expiry() or now + 1) <= now
        first_entry_at = tx.first_log_entry_at_ms()
        log_due = first_entry_at is not None and first_entry_at < now - config.journal_retention_ms

    def tidy(
        tx: LmdbShardTransaction,
        context: ShardContext,
        at: int,
        expire_due: bool = expire_due,
        dedup_due: bool = dedup_due,
        log_due: bool = log_due,
    ) -> int:
        expired = 0
        if expire_due:
            expired = housekeeping.expire_messages(tx, context, now_ms=at, limit=EXPIRE_BATCH)
        if dedup_due:
            housekeeping.prune_dedup(tx, context, now_ms=at)
        if log_due:
            tx.prune_log(
                before_ms=at - config.journal_retention_ms, keep_after_index=tx.last_index(), limit=LOG_PRUNE_BATCH
            )
        return expired

    if expire_due or dedup_due or log_due:
        expired = await shard.committer.submit(tidy)
        if expired:
            shard.expired.inc(expired)
            log.info("queue %s shard %d: %d messages expired", config.name, shard.index, expired)


async def move_dead_letters(host: QueueHost, queue: HostedQueue) -> None:
    """Hand dead-lettered messages to the dead-letter queue, then remove them here.

    The copy carries a dedup id derived from the message id, so a crash between
    the copy and the removal cannot leave two copies in a deduplicating DLQ, and
    a message is removed here only after the DLQ acknowledged it.
    """
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(queue.dead_letters_waiting.wait(), timeout=HOUSEKEEPING_PERIOD_S)
        queue.dead_letters_waiting.clear()
        # Read every round: the queue's settings may change while it runs.
        name = queue.config.dead_letter_queue
        target = host.queues.get(name) if name else None
        if target is None:
            continue
        for shard in queue.shards:
            if not shard.is_local_leader():
                continue
            try:
                await _move_shard_dead_letters(queue, shard, target)
            except Exception as error:  # the DLQ refused or is failing over: next round
                log.warning("queue %s shard %d: moving dead letters to %s failed (%s); retrying",
                            queue.config.name, shard.index, name, error)  # fmt: skip


async def _move_shard_dead_letters(queue: HostedQueue, shard: HostedShard, target: HostedQueue) -> None:
    while True:
        # Never more at once than the DLQ could ever hold: a larger batch is refused outright.
        batch = min(DEAD_LETTER_BATCH, target.config.max_depth or DEAD_LETTER_BATCH)
        with shard.environment.read() as tx:
            pending = [(tx.get_record(seq), tx.get_delivery(seq)) for seq in tx.dead_letter_pending(limit=batch)]
        present = [(record, delivery) for record, delivery in pending if record is not None]
        if not present:
            return
        copies = [
            build_moved_copy(
                body=record.body,
                attributes={
                    **record.attributes,
                    **dead_letter_attributes(queue.config, delivery),
                },
                group_id=record.group_id,
                dedup_id="dlq:" + format_message_id(sent_at_ms=record.sent_at_ms, shard=shard.index, seq=record.seq),
                source=queue.config.name,
                target=target.config,
                priority=delivery.priority if delivery is not None else 0,
            )
            for record, delivery in present
        ]
        entries = await target.send(copies)
        delivered = [record.seq for (record, _), entry in zip(present, entries, strict=True) if entry.error is None]
        if delivered:
            await shard.committer.submit(functools.partial(_complete_dead_letters, seqs=delivered))
        if len(delivered) < len(present):
            return  # the DLQ refused some (e.g. full): try again on the next round


def _complete_dead_letters(tx: LmdbShardTransaction, context: ShardContext, now: int, *, seqs: list[int]) -> int:
    return housekeeping.complete_dead_letters(tx, context, seqs, now_ms=now)


@dataclasses.dataclass(frozen=True, slots=True)
class RedriveProgress:
    moved: int
    remaining: int
    done: bool
    # Left in the source by a redrive back to the messages' own queues: not dead-lettered
    # from a queue that sends its dead letters there (sent to it directly, or from a queue
    # since pointed elsewhere or deleted).
    kept: int = 0


# How long a redrive waits for a source shard whose leader does not answer (killed,
# stopped, failing over), in lease durations: one for the lease to expire, then the
# takeover and the new leader's start, with room to spare. Past that it ends not done,
# naming the shard, rather than reading the silence as "nothing left there".
REDRIVE_WAITS_LEASES = 5
# Between tries at such a shard: a few route refreshes (ROUTE_REFRESH_S), so a new
# leader is asked soon after its lease names it.
REDRIVE_RETRY_S = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class _Taken:
    """A message claimed for a redrive, by this server or by its shard's leader elsewhere."""

    body: bytes
    attributes: dict[str, str]
    group_id: str
    message_id: str
    receipt: str
    # Its lane in the queue it was dead-lettered from, else in the DLQ.
    priority: int


def _priority_before(attributes: Mapping[str, str], priority: int) -> int:
    """The priority a dead letter had in its own queue (PRIORITY_ATTRIBUTE), else `priority`."""
    noted = attributes.get(PRIORITY_ATTRIBUTE, "")
    return int(noted) if noted.isdigit() else priority


@dataclasses.dataclass(slots=True)
class _ClaimRound:
    """What one round of redrive claims found, shard by shard."""

    taken: list[_Taken] = dataclasses.field(default_factory=list)
    # Shards whose leader answered, with messages or without; `emptied`: those without.
    answered: list[int] = dataclasses.field(default_factory=list)
    emptied: list[int] = dataclasses.field(default_factory=list)
    # Shards whose leader could not be asked or did not answer, and why.
    unanswered: dict[int, ShardqError] = dataclasses.field(default_factory=dict)


def _leader_wait_s(queue: HostedQueue) -> float:
    lease_ms = queue.router.cluster.lease_duration_ms if queue.router is not None else DEFAULT_LEASE_DURATION_MS
    return REDRIVE_WAITS_LEASES * lease_ms / 1000


async def _count_messages(queue: HostedQueue) -> tuple[int, dict[int, ShardqError]]:
    """Every message of the queue, shard by shard: those led here, and the other shards'
    as their leaders count them; and the shards nobody counted, with why. A redrive that
    silently left a shard out would stop short of it and report the DLQ drained."""
    counted: dict[int, int] = {
        shard.index: stats.messages - stats.dead_letter_pending for shard, stats in await asyncio.to_thread(queue.stats)
    }
    answered, unanswered = await queue.ask_other_leaders(
        lambda calls, leader: calls.queue_attributes(leader, queue.config.name, timeout_s=10)
    )
    for _, attributes in answered:
        for shard in attributes.shards:
            counted.setdefault(shard.shard, shard.visible + shard.in_flight + shard.delayed)
    for index in range(queue.config.shards):
        if index not in counted and index not in unanswered:
            unanswered[index] = queue.no_leader_known(index) or NotLeader(
                f"queue {queue.config.name!r} shard {index} was not counted by the leader the routes named"
            )
    return sum(counted.values()), {index: unanswered[index] for index in sorted(unanswered)}


async def _claim_in_turn(queue: HostedQueue, shards: list[int], *, max_messages: int) -> _ClaimRound:
    """Claim up to `max_messages` for a redrive from `shards`, in that order, each from its
    own leader (here, or forwarded). A queue-wide receive passes over a leader that does
    not answer and so hands out nothing, which reads as "drained": here such a shard is
    named instead."""
    found = _ClaimRound()
    for index in shards:
        wanted = max_messages - len(found.taken)
        if not wanted:
            break
        away = queue.no_leader_known(index)
        if away is not None:
            found.unanswered[index] = away
            continue
        try:
            claimed = await queue.receive(
                max_messages=wanted, visibility_timeout_ms=REDRIVE_CLAIM_MS, wait_ms=0, shard=index
            )
        except ShardqError as error:
            if error.reason not in LEADER_AWAY_REASONS:
                raise
            found.unanswered[index] = error
            continue
        found.answered.append(index)
        if not claimed:
            found.emptied.append(index)
        found.taken += [
            _Taken(
                body=message.record.body,
                attributes=message.record.attributes,
                group_id=message.record.group_id,
                message_id=format_message_id(
                    sent_at_ms=message.record.sent_at_ms, shard=shard.index, seq=message.record.seq
                ),
                receipt=encode_receipt(message.receipt),
                priority=_priority_before(message.record.attributes, message.delivery.priority),
            )
            for shard, message in claimed.local
        ] + [
            _Taken(
                m.body,
                dict(m.attributes),
                m.group_id,
                m.message_id,
                m.receipt,
                _priority_before(m.attributes, m.priority),
            )
            for m in claimed.remote
        ]
    return found


def _log_unanswered(source: str, unanswered: dict[int, ShardqError], *, now: str) -> None:
    for index, error in unanswered.items():
        log.warning("redrive from %s: the leader of shard %d did not answer (%s); %s", source, index, error, now)


async def redrive(
    host: QueueHost,
    *,
    source: str,
    destination: str,
    rate_per_second: float,
    max_messages: int,
    destinations: Mapping[str, HostedQueue] | None = None,
) -> AsyncIterator[RedriveProgress]:
    """Move messages from `source` (a DLQ) to `destination`, at most `rate_per_second`.

    Without a `destination`, each message goes back to the queue it was dead-lettered
    from (DEAD_LETTER_SOURCE_ATTRIBUTE), if that queue still sends its dead letters to
    `source`: SQS's redrive to the source queues, and the only right one for a DLQ that
    several queues share. Messages with no such queue stay in `source` (`kept`), claimed
    until the redrive ends so it does not take them again, then visible at once.

    Done when every message counted at the start (or `max_messages`) moved, or when every
    shard's leader answered with nothing to hand out (the rest is in flight or delayed;
    `remaining` counts it). A shard whose leader does not answer is tried again, on the
    routes the leases give meanwhile, for REDRIVE_WAITS_LEASES lease durations; after that
    the redrive ends not done: a last progress with done=False, then UNAVAILABLE naming the
    shards. Their messages stay in `source` for another redrive.

    `destinations`: redrive_destinations' answer, when the caller asked it first (to
    authorize each), so that the queues moved to are the ones it allowed.
    """
    if destinations is None:
        destinations = redrive_destinations(host, source, destination)
    if not (math.isfinite(rate_per_second) and rate_per_second >= 0):
        # NaN passed a `< 0` check and failed later as a ValueError, infinity as an
        # OverflowError: to the client, UNKNOWN errors with no reason.
        raise InvalidArgument("rate_per_second", f"must be a finite number >= 0 (0: no limit), not {rate_per_second}")
    from_queue = host.get(source)
    going_to = destination or "the queues its messages came from"
    loop = asyncio.get_running_loop()
    wait_s = _leader_wait_s(from_queue)
    counting_since = loop.time()
    while True:
        present, uncounted = await _count_messages(from_queue)
        if not uncounted:
            break
        if loop.time() - counting_since >= wait_s:
            _log_unanswered(source, uncounted, now="not starting")
            raise Unavailable(
                f"redrive from {source} to {going_to} did not start: no leader counted "
                f"{shards_away(source, uncounted)} for {loop.time() - counting_since:.0f}s; "
                "run it again after the failover"
            )
        await asyncio.sleep(REDRIVE_RETRY_S)
    target = min(max_messages, present) if max_messages else present
    moved = 0
    # Messages with nowhere to return to, claimed (so not taken again) until the end: by
    # message id, the receipt of its latest claim (a redrive longer than REDRIVE_CLAIM_MS
    # may take one again, and counts it once).
    kept: dict[str, str] = {}
    # Copied to a destination, yet still in the source (its delete failed), and why.
    not_deleted = 0
    delete_failures: set[Reason] = set()
    # At a rate, batches of a tenth of a second's worth: 10/s moves one message every
    # 100 ms, rather than a burst of a hundred and then a long pause.
    batch_size = REDRIVE_BATCH if not rate_per_second else max(1, min(REDRIVE_BATCH, int(rate_per_second / 10)))
    depths = [queue.config.max_depth for queue in destinations.values() if queue.config.max_depth]
    if depths:
        batch_size = min(batch_size, *depths)  # larger batches could never fit
    # Shards that had nothing to hand out go last: a batch asks them only when the
    # others cannot fill it.
    order = list(range(from_queue.config.shards))
    unanswered: dict[int, ShardqError] = {}
    # Since when no claim took anything while some shard's leader did not answer.
    stalled_since: float | None = None
    paced_since, paced_from = loop.time(), 0

    def progress(*, done: bool) -> RedriveProgress:
        return RedriveProgress(moved, max(target - moved - len(kept), 0), done=done, kept=len(kept))

    try:
        while moved + len(kept) < target:
            # Shards whose leader did not answer go after the rest, whose messages move meanwhile.
            turn = sorted(order, key=lambda index: index in unanswered)
            found = await _claim_in_turn(from_queue, turn, max_messages=min(batch_size, target - moved - len(kept)))
            _log_unanswered(
                source, {i: e for i, e in found.unanswered.items() if i not in unanswered}, now="trying it again"
            )
            for index in found.answered:
                unanswered.pop(index, None)
            unanswered.update(found.unanswered)
            order = [index for index in order if index not in found.emptied] + found.emptied
            if not found.taken:
                if not unanswered:
                    break  # every shard's leader answered, with nothing to hand out
                now = loop.time()
                stalled_since = now if stalled_since is None else stalled_since
                if now - stalled_since < wait_s:
                    await asyncio.sleep(REDRIVE_RETRY_S)
                    continue
                _log_unanswered(source, unanswered, now="stopping with messages left")
                yield progress(done=False)
                raise Unavailable(
                    f"redrive from {source} to {going_to} stopped: no leader answered for "
                    f"{shards_away(source, unanswered)} in {now - stalled_since:.0f}s; the messages there stay "
                    "in the queue: run the redrive again after the failover"
                )
            if stalled_since is not None:
                # Moving again after a wait: the rate counts from now, not as though the wait
                # had been spent moving (which would make up for it with a burst).
                stalled_since = None
                paced_since, paced_from = loop.time(), moved
            by_destination: dict[str, list[_Taken]] = {}
            for taken in found.taken:
                back_to = destination or taken.attributes.get(DEAD_LETTER_SOURCE_ATTRIBUTE, "")
                if back_to in destinations:
                    by_destination.setdefault(back_to, []).append(taken)
                else:
                    kept[taken.message_id] = taken.receipt
            copied: list[str] = []
            failed: list[str] = []
            first_error: ShardqError | None = None
            for name, going in by_destination.items():
                to_queue = destinations[name]
                copies = [
                    build_moved_copy(
                        body=taken.body,
                        # Back to work: the dead-letter notes stay behind.
                        attributes={
                            k: v for k, v in taken.attributes.items() if not k.startswith(RESERVED_ATTRIBUTE_PREFIX)
                        },
                        group_id=taken.group_id,
                        dedup_id=f"redrive:{source}:{taken.message_id}",
                        source=source,
                        target=to_queue.config,
                        priority=taken.priority,
                    )
                    for taken in going
                ]
                entries = await to_queue.send(copies)
                for taken, entry in zip(going, entries, strict=True):
                    if entry.error is None:
                        copied.append(taken.receipt)
                    else:
                        failed.append(taken.receipt)
                        first_error = first_error or entry.error
            deleted = 0
            if copied:
                outcomes = await from_queue.delete(copied)
                deleted = outcomes.count(None)
                not_deleted += len(copied) - deleted
                delete_failures.update(outcome for outcome in outcomes if outcome is not None)
            if first_error is not None:
                await from_queue.change_visibility([(receipt, 0) for receipt in failed])
                moved += deleted
                yield progress(done=False)
                raise first_error
            moved += deleted
            yield progress(done=False)
            if rate_per_second:
                ahead_s = (moved - paced_from) / rate_per_second - (loop.time() - paced_since)
                if ahead_s > 0:
                    await asyncio.sleep(ahead_s)
        if not_deleted:
            # Their claims end after REDRIVE_CLAIM_MS and they are visible in the source again;
            # moved again within the destination's dedup window, they make no second copy.
            yield progress(done=False)
            raise Unavailable(
                f"redrive from {source} to {going_to} stopped: {not_deleted} message(s) copied to {going_to} "
                f"could not be removed from {source} ({', '.join(sorted(delete_failures))}) and may be moved "
                "again by the next redrive"
            )
        yield progress(done=True)
    finally:
        if kept:
            # Visible again at once, for a redrive elsewhere; should this fail, their claims
            # end after REDRIVE_CLAIM_MS anyway.
            receipts = list(kept.values())
            with contextlib.suppress(ShardqError):
                for at in range(0, len(receipts), REDRIVE_BATCH):
                    await from_queue.change_visibility([(receipt, 0) for receipt in receipts[at : at + REDRIVE_BATCH]])


def redrive_destinations(host: QueueHost, source: str, destination: str) -> dict[str, HostedQueue]:
    """The queues a redrive of `source` may move messages to: `destination`, or without
    one, the queues that send their dead letters to `source`. QueueNotFound for a queue
    that does not exist, InvalidArgument for a destination that is the source, or for no
    destination and no queue to return to."""
    if source == destination:
        raise InvalidArgument("destination", "must differ from source")
    host.get(source)
    if destination:
        return {destination: host.get(destination)}
    returning = {name: queue for name, queue in list(host.queues.items()) if queue.config.dead_letter_queue == source}
    if not returning:
        raise InvalidArgument(
            "destination",
            f"no queue sends its dead letters to {source!r}, so its messages have no queue to return to: name one",
        )
    return returning
