"""The queues a server hosts: shards with their committers, long polling, routing.

HostedQueue turns queue-level requests into per-shard domain calls submitted to
each shard's group committer, and wakes long-polling receivers when a commit
may have made a message visible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import Counter

from shard_server import metrics
from shard_server.domain import acknowledging, housekeeping, receiving, sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.domain.receiving import ClaimedMessage
from shard_server.domain.routing import choose_shard
from shard_server.runtime.committing import CommitReport, GroupCommitter, wall_clock_ms
from shard_server.storage.lmdb_store import (
    DEFAULT_MAP_SIZE,
    LmdbShardTransaction,
    ShardEnvironment,
    ShardStats,
)
from shardq.errors import QueueNotFound, Reason, ShardqError
from shardq.queues import QueueConfig
from shardq.receipts import MalformedReceipt, Receipt, decode_receipt

log = logging.getLogger(__name__)

_SHARD_DIR = re.compile(r"shard-(\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class SendEntry:
    """The outcome of one message of a send batch: stored, duplicate, or refused."""

    message_id: str = ""
    seq: int = 0
    shard: int = 0
    duplicate: bool = False
    error: ShardqError | None = None


class HostedShard:
    def __init__(self, queue: HostedQueue, index: int, environment: ShardEnvironment, epoch: int) -> None:
        self.queue = queue
        self.index = index
        self.environment = environment
        self.epoch = epoch
        labels = (queue.config.name, str(index))
        self.sent = metrics.SENT.labels(*labels)
        self.duplicates = metrics.DUPLICATES.labels(*labels)
        self.received = metrics.RECEIVED.labels(*labels)
        self.redelivered = metrics.REDELIVERED.labels(*labels)
        self.deleted = metrics.DELETED.labels(*labels)
        self.released = metrics.RELEASED.labels(*labels)
        self.expired = metrics.EXPIRED.labels(*labels)
        self.dead_lettered = metrics.DEAD_LETTERED.labels(*labels, receiving.DEAD_LETTER_REASON_MAX_RECEIVES)
        self._commits = metrics.COMMITS.labels(*labels)
        self._batch = metrics.COMMIT_BATCH.labels(*labels)
        self.committer = GroupCommitter(
            environment,
            self.context,
            name=f"{queue.config.name}-{index}",
            on_commit=self._on_commit,
        )

    def context(self) -> ShardContext:
        return ShardContext(self.queue.config, self.index, self.epoch)

    def _on_commit(self, report: CommitReport) -> None:
        if report.log_index:
            self._commits.inc()
            self._batch.observe(report.requests)
        self.queue.wake()

    def next_visible_at(self) -> int | None:
        with self.environment.read() as tx:
            return tx.next_visible_at()

    def stats(self) -> ShardStats:
        return self.environment.stats(now_ms=wall_clock_ms())

    def count_rejections(self, reasons: Iterable[Reason | None]) -> None:
        for reason in reasons:
            if reason is not None:
                metrics.REJECTED_RECEIPTS.labels(self.queue.config.name, str(self.index), reason.value).inc()


class HostedQueue:
    def __init__(self, config: QueueConfig, directory: pathlib.Path, *, map_size: int) -> None:
        self.config = config
        self._waiters: set[asyncio.Future[None]] = set()
        self._round_robin = itertools.count()
        self._receive_start = itertools.count()
        # Set when a receive dead-letters something; the mover then runs at once.
        self.dead_letters_waiting = asyncio.Event()
        _refuse_orphaned_shards(config, directory)
        self.shards: list[HostedShard] = []
        for index in range(config.shards):
            environment = ShardEnvironment(
                directory / f"shard-{index}", queue=config.name, shard=index, map_size=map_size
            )
            # Standalone leadership: every start is a new epoch, so a claim made
            # just before a crash (answered, never committed) can never be
            # confused with a claim made after the restart.
            epoch = environment.epoch() + 1
            environment.set_epoch(epoch)
            self.shards.append(HostedShard(self, index, environment, epoch))

    # -- waking long pollers ---------------------------------------------------
    def wake(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for_change(self, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout=max(timeout_s, 0.0))
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    # -- send --------------------------------------------------------------------
    async def send(self, messages: Sequence[NewMessage]) -> list[SendEntry]:
        by_shard: dict[int, list[int]] = {}
        start = next(self._round_robin)
        for position, message in enumerate(messages):
            shard = choose_shard(self.config, message, round_robin=start)
            by_shard.setdefault(shard, []).append(position)
        entries: list[SendEntry] = [SendEntry()] * len(messages)

        async def send_to(shard: HostedShard, positions: list[int]) -> None:
            batch = [messages[p] for p in positions]
            try:
                outcomes = await shard.committer.submit(
                    lambda tx, context, now: sending.send_messages(tx, context, batch, now_ms=now)
                )
            except ShardqError as error:
                for position in positions:
                    entries[position] = SendEntry(shard=shard.index, error=error)
                return
            duplicates = 0
            for position, outcome in zip(positions, outcomes, strict=True):
                duplicates += outcome.duplicate
                entries[position] = SendEntry(outcome.message_id, outcome.seq, shard.index, outcome.duplicate)
            shard.sent.inc(len(outcomes) - duplicates)
            if duplicates:
                shard.duplicates.inc(duplicates)

        if len(by_shard) == 1:
            ((shard_index, positions),) = by_shard.items()
            await send_to(self.shards[shard_index], positions)
        else:
            await asyncio.gather(*(send_to(self.shards[i], p) for i, p in by_shard.items()))
        errors = [entry.error for entry in entries if entry.error is not None]
        if errors and len(errors) == len(entries):
            raise errors[0]  # nothing was stored: fail the whole call
        return entries

    # -- receive -----------------------------------------------------------------
    async def receive(
        self, *, max_messages: int, visibility_timeout_ms: int, wait_ms: int
    ) -> list[tuple[HostedShard, ClaimedMessage]]:
        deadline = wall_clock_ms() + wait_ms
        while True:
            claimed = await self._claim_now(max_messages, visibility_timeout_ms)
            now = wall_clock_ms()
            if claimed or now >= deadline:
                return claimed
            wake_at = deadline
            for shard in self.shards:
                visible_at = shard.next_visible_at()
                if visible_at is not None:
                    wake_at = min(wake_at, max(visible_at, now + 1))
            await self._wait_for_change((wake_at - now) / 1000)

    async def _claim_now(
        self, max_messages: int, visibility_timeout_ms: int
    ) -> list[tuple[HostedShard, ClaimedMessage]]:
        now = wall_clock_ms()
        count = len(self.shards)
        start = next(self._receive_start)
        claimed: list[tuple[HostedShard, ClaimedMessage]] = []
        for offset in range(count):
            shard = self.shards[(start + offset) % count]
            visible_at = shard.next_visible_at()
            if visible_at is None or visible_at > now:
                continue  # a read transaction is far cheaper than a write batch
            wanted = max_messages - len(claimed)
            outcome = await shard.committer.submit(
                functools.partial(_claim, max_messages=wanted, visibility_timeout_ms=visibility_timeout_ms),
                answer_before_commit=True,
            )
            if outcome.dead_lettered:
                shard.dead_lettered.inc(outcome.dead_lettered)
                self.wake_dead_letter_mover()
            if outcome.claimed:
                shard.received.inc(len(outcome.claimed))
                redelivered = sum(1 for c in outcome.claimed if c.delivery.receive_count > 1)
                if redelivered:
                    shard.redelivered.inc(redelivered)
                claimed.extend((shard, message) for message in outcome.claimed)
            if len(claimed) >= max_messages:
                break
        return claimed

    def wake_dead_letter_mover(self) -> None:
        self.dead_letters_waiting.set()

    # -- acting on receipts ----------------------------------------------------
    def _decode(self, receipts: Sequence[str]) -> tuple[list[Reason | None], dict[int, list[tuple[int, Receipt]]]]:
        results: list[Reason | None] = [None] * len(receipts)
        by_shard: dict[int, list[tuple[int, Receipt]]] = {}
        for position, text in enumerate(receipts):
            try:
                receipt = decode_receipt(text)
            except MalformedReceipt:
                results[position] = Reason.MALFORMED_RECEIPT
                continue
            if receipt.shard >= len(self.shards):
                results[position] = Reason.WRONG_QUEUE
                continue
            by_shard.setdefault(receipt.shard, []).append((position, receipt))
        return results, by_shard

    async def _act_on_receipts(
        self,
        receipts: Sequence[str],
        act: Callable[[LmdbShardTransaction, ShardContext, Receipt, int, int], Reason | None],
        succeeded_counter: Callable[[HostedShard], Counter] | None,
    ) -> list[Reason | None]:
        """Apply `act(tx, context, receipt, position, now)` to every receipt, per shard."""
        results, by_shard = self._decode(receipts)

        async def act_on(shard: HostedShard, items: list[tuple[int, Receipt]]) -> None:
            def work(tx: LmdbShardTransaction, context: ShardContext, now: int) -> list[Reason | None]:
                return [act(tx, context, receipt, position, now) for position, receipt in items]

            outcomes = await shard.committer.submit(work)
            for (position, _), outcome in zip(items, outcomes, strict=True):
                results[position] = outcome
            shard.count_rejections(outcomes)
            succeeded = sum(1 for outcome in outcomes if outcome is None)
            if succeeded and succeeded_counter is not None:
                succeeded_counter(shard).inc(succeeded)

        await asyncio.gather(*(act_on(self.shards[index], items) for index, items in by_shard.items()))
        return results

    async def delete(self, receipts: Sequence[str]) -> list[Reason | None]:
        return await self._act_on_receipts(
            receipts,
            lambda tx, context, receipt, _, now: acknowledging.delete_message(tx, context, receipt, now_ms=now),
            lambda shard: shard.deleted,
        )

    async def release(self, receipts: Sequence[str]) -> list[Reason | None]:
        return await self._act_on_receipts(
            receipts,
            lambda tx, context, receipt, _, now: acknowledging.release_message(tx, context, receipt, now_ms=now),
            lambda shard: shard.released,
        )

    async def change_visibility(self, changes: Sequence[tuple[str, int]]) -> list[Reason | None]:
        timeouts = [timeout for _, timeout in changes]
        return await self._act_on_receipts(
            [receipt for receipt, _ in changes],
            lambda tx, context, receipt, position, now: acknowledging.change_visibility(
                tx, context, receipt, visibility_timeout_ms=timeouts[position], now_ms=now
            ),
            None,
        )

    # -- administration ----------------------------------------------------------
    async def purge(self) -> int:
        counts = await asyncio.gather(
            *(
                shard.committer.submit(lambda tx, context, now: housekeeping.purge(tx, context, now_ms=now))
                for shard in self.shards
            )
        )
        return sum(counts)

    def stats(self) -> list[ShardStats]:
        return [shard.stats() for shard in self.shards]

    async def close(self) -> None:
        for shard in self.shards:
            await shard.committer.close()
            shard.environment.close()


def _claim(
    tx: LmdbShardTransaction, context: ShardContext, now: int, *, max_messages: int, visibility_timeout_ms: int
) -> receiving.ReceiveOutcome:
    return receiving.receive_messages(
        tx, context, max_messages=max_messages, visibility_timeout_ms=visibility_timeout_ms, now_ms=now
    )


def _refuse_orphaned_shards(config: QueueConfig, directory: pathlib.Path) -> None:
    """Shrinking a queue's shard count would strand the messages of the shards dropped."""
    if not directory.exists():
        return
    for child in directory.iterdir():
        match = _SHARD_DIR.fullmatch(child.name)
        if match and int(match.group(1)) >= config.shards:
            raise ValueError(
                f"queue {config.name!r} has data in {child} but is configured with {config.shards} shards; "
                "shard counts can grow but not shrink"
            )


class QueueHost:
    """Every queue this server hosts, opened from one data directory."""

    def __init__(self, data_dir: pathlib.Path, configs: Iterable[QueueConfig], *, map_size: int = DEFAULT_MAP_SIZE):
        self.data_dir = data_dir
        # What DescribeQueue names as every shard's leader until replication
        # places leaders on several servers; set by the server once bound.
        self.advertised_address = ""
        self.queues: dict[str, HostedQueue] = {}
        for config in configs:
            if config.name in self.queues:
                raise ValueError(f"queue {config.name!r} is configured twice")
            self.queues[config.name] = HostedQueue(config, data_dir / "queues" / config.name, map_size=map_size)
        for queue in self.queues.values():
            dead_letter_queue = queue.config.dead_letter_queue
            if dead_letter_queue and dead_letter_queue not in self.queues:
                log.warning(
                    "queue %s: dead-letter queue %s is not hosted here; dead letters stay pending until it is",
                    queue.config.name,
                    dead_letter_queue,
                )

    def get(self, name: str) -> HostedQueue:
        queue = self.queues.get(name)
        if queue is None:
            raise QueueNotFound(name)
        return queue

    def shard_stats_sources(self) -> list[tuple[str, int, HostedShard]]:
        return [(queue.config.name, shard.index, shard) for queue in self.queues.values() for shard in queue.shards]

    async def close(self) -> None:
        for queue in self.queues.values():
            await queue.close()
