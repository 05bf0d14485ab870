"""Background loops of a server: retention and pruning per shard, the dead-letter
mover per queue, and rate-limited redrive from a dead-letter queue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator

from shard_server.domain import housekeeping
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import Delivery, NewMessage, format_message_id
from shard_server.domain.validation import RESERVED_ATTRIBUTE_PREFIX
from shard_server.runtime.committing import wall_clock_ms
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.storage.lmdb_store import LmdbShardTransaction
from shardq.errors import InvalidArgument
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
    *, body: bytes, attributes: dict[str, str], group_id: str, dedup_id: str, source: str, target: QueueConfig
) -> NewMessage:
    """A message moved to another queue (dead-lettering, redrive): visible at once,
    remembering where it came from, deduplicated by an id derived from the original
    so a retried move never makes two copies, and grouped by its source queue when
    the target is FIFO and the message had no group."""
    return NewMessage(
        body=body,
        attributes=attributes,
        group_id=group_id or (source if target.fifo else ""),
        dedup_id=dedup_id,
        delay_ms=0,
        source_queue=source,
    )


DEAD_LETTER_SOURCE_ATTRIBUTE = "shardq.dead_letter.source_queue"
DEAD_LETTER_REASON_ATTRIBUTE = "shardq.dead_letter.reason"
LAST_ERROR_ATTRIBUTE = "shardq.dead_letter.last_error"


def dead_letter_attributes(source: QueueConfig, delivery: Delivery | None) -> dict[str, str]:
    """What a dead-letter copy says about itself: where from, why, and the last error
    its handlers gave when releasing it (reserved keys: senders cannot set them)."""
    receives = delivery.receive_count if delivery is not None else 0
    attributes = {
        DEAD_LETTER_SOURCE_ATTRIBUTE: source.name,
        DEAD_LETTER_REASON_ATTRIBUTE: f"received {receives} times (max_receive_count {source.max_receive_count})",
    }
    if delivery is not None and delivery.last_error:
        attributes[LAST_ERROR_ATTRIBUTE] = delivery.last_error
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


async def _messages_in(queue: HostedQueue) -> int:
    """Every message of the queue, on every shard: those led here, and the other shards'
    as their leaders count them. A leader that cannot be asked fails the count: a redrive
    that silently skipped its shards would report the DLQ empty while it is not."""
    local = await asyncio.to_thread(queue.stats)
    present = sum(stats.messages - stats.dead_letter_pending for _, stats in local)
    if queue.router is not None:
        for leader in queue.remote_leaders():
            remote = await queue.router.calls.queue_attributes(leader, queue.config.name, timeout_s=10)
            present += sum(shard.visible + shard.in_flight + shard.delayed for shard in remote.shards)
    return present


async def redrive(
    host: QueueHost, *, source: str, destination: str, rate_per_second: float, max_messages: int
) -> AsyncIterator[RedriveProgress]:
    """Move messages from `source` (a DLQ) to `destination`, at most `rate_per_second`."""
    if source == destination:
        raise InvalidArgument("destination", "must differ from source")
    if not (math.isfinite(rate_per_second) and rate_per_second >= 0):
        # NaN passed a `< 0` check and failed later as a ValueError, infinity as an
        # OverflowError: to the client, UNKNOWN errors with no reason.
        raise InvalidArgument("rate_per_second", f"must be a finite number >= 0 (0: no limit), not {rate_per_second}")
    from_queue = host.get(source)
    to_queue = host.get(destination)
    present = await _messages_in(from_queue)
    target = min(max_messages, present) if max_messages else present
    moved = 0
    # At a rate, batches of a tenth of a second's worth: 10/s moves one message every
    # 100 ms, rather than a burst of a hundred and then a long pause.
    batch_size = REDRIVE_BATCH if not rate_per_second else max(1, min(REDRIVE_BATCH, int(rate_per_second / 10)))
    if to_queue.config.max_depth:
        batch_size = min(batch_size, to_queue.config.max_depth)  # larger batches could never fit
    started = asyncio.get_running_loop().time()
    while moved < target:
        claimed = await from_queue.receive(
            max_messages=min(batch_size, target - moved), visibility_timeout_ms=REDRIVE_CLAIM_MS, wait_ms=0
        )
        if not claimed:
            break
        # (body, attributes, group id, message id, receipt) of local and forwarded claims alike.
        taken = [
            (
                message.record.body,
                message.record.attributes,
                message.record.group_id,
                format_message_id(sent_at_ms=message.record.sent_at_ms, shard=shard.index, seq=message.record.seq),
                encode_receipt(message.receipt),
            )
            for shard, message in claimed.local
        ] + [(m.body, dict(m.attributes), m.group_id, m.message_id, m.receipt) for m in claimed.remote]
        copies = [
            build_moved_copy(
                body=body,
                # Back to work: the dead-letter notes stay behind.
                attributes={k: v for k, v in attributes.items() if not k.startswith(RESERVED_ATTRIBUTE_PREFIX)},
                group_id=group_id,
                dedup_id=f"redrive:{source}:{message_id}",
                source=source,
                target=to_queue.config,
            )
            for body, attributes, group_id, message_id, _ in taken
        ]
        receipts = [receipt for *_, receipt in taken]
        entries = await to_queue.send(copies)
        copied = [receipt for receipt, entry in zip(receipts, entries, strict=True) if entry.error is None]
        failed = [receipt for receipt, entry in zip(receipts, entries, strict=True) if entry.error is not None]
        if copied:
            await from_queue.delete(copied)
        if failed:
            await from_queue.change_visibility([(receipt, 0) for receipt in failed])
            first_error = next(entry.error for entry in entries if entry.error is not None)
            yield RedriveProgress(moved + len(copied), max(target - moved - len(copied), 0), done=False)
            raise first_error
        moved += len(copied)
        yield RedriveProgress(moved, target - moved, done=False)
        if rate_per_second:
            ahead_s = moved / rate_per_second - (asyncio.get_running_loop().time() - started)
            if ahead_s > 0:
                await asyncio.sleep(ahead_s)
    yield RedriveProgress(moved, max(target - moved, 0), done=True)
