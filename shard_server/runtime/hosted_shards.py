"""One shard a server hosts: its LMDB environment, its group committer, its metrics, and
what its replica says about leading it.

HostedQueue (runtime.hosting) holds a queue's shards and turns its requests into calls on
them; QueueHost (runtime.queue_hosts) holds every queue.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from shard_server import metrics
from shard_server.domain import receiving
from shard_server.domain.context import ShardContext
from shard_server.runtime.committing import CommitReport, GroupCommitter, WriterThreads, wall_clock_ms
from shard_server.storage.closing_gate import EnvironmentClosed
from shard_server.storage.lmdb_store import ShardEnvironment, ShardStats
from shardq.errors import Reason
from shardq.queues import QueueConfig

LOAD_WINDOW_S = 5.0


class ShardsQueue(Protocol):
    """What a shard needs of the queue that holds it (runtime.hosting.HostedQueue)."""

    @property
    def config(self) -> QueueConfig: ...

    @property
    def uid(self) -> str:
        """Which creation of the queue this is ("" when the map does not say)."""

    def wake(self) -> None:
        """A commit may have made a message visible: wake the queue's waiting receivers."""


class Leadership(Protocol):
    """What a hosted shard asks its replica (runtime.replication) in cluster mode: whether
    this server leads it, and when a write is committed on the in-sync replicas."""

    @property
    def commit_index(self) -> int: ...

    @property
    def replicas(self) -> Sequence[str]: ...

    @property
    def isr(self) -> frozenset[str]: ...

    def is_serving(self) -> bool: ...

    def require_serving(self) -> None:
        """Raise NotLeader (naming the leader) unless this replica serves the shard."""

    async def wait_committed(self, index: int, epoch: int) -> None: ...

    async def readable_through(self, index: int) -> int:
        """The last entry up to `index` a journal reader may see: committed."""

    async def wait_known_committed(self, index: int) -> bool:
        """Whether entry `index` is committed, waiting (bounded) for it."""

    def note_local_commit(self, index: int) -> None: ...

    def follower_lag(self) -> dict[str, int]: ...


class HostedShard:
    def __init__(
        self,
        queue: ShardsQueue,
        index: int,
        environment: ShardEnvironment,
        epoch: int,
        *,
        replicated: bool,
        writers: WriterThreads,
    ) -> None:
        self.queue = queue
        self.index = index
        self.environment = environment
        self.epoch = epoch
        # Set in cluster mode: leadership from the shard's lease, and log shipping.
        self.replica: Leadership | None = None
        with environment.read() as tx:
            self.last_written_index = tx.last_index()
        self._load_window_started = time.monotonic()
        self._load_requests = 0
        self._load = 0.0
        labels = (queue.config.name, str(index))
        self.sent = metrics.SENT.labels(*labels)
        self.duplicates = metrics.DUPLICATES.labels(*labels)
        self.received = metrics.RECEIVED.labels(*labels)
        self.redelivered = metrics.REDELIVERED.labels(*labels)
        self.deleted = metrics.DELETED.labels(*labels)
        self.released = metrics.RELEASED.labels(*labels)
        self.expired = metrics.EXPIRED.labels(*labels)
        self.dead_lettered = metrics.DEAD_LETTERED.labels(*labels, receiving.DEAD_LETTER_REASON_MAX_RECEIVES)
        self.rejected_to_dead_letters = metrics.DEAD_LETTERED.labels(*labels, receiving.DEAD_LETTER_REASON_REJECTED)
        # Exported at 0 from the start, as every counter above: the refusals an alert watches
        # must show as an increase (a series first scraped at 1 hides them from rate()).
        metrics.SENDS_REFUSED.labels(*labels, Reason.QUEUE_FULL.value)
        self._commits = metrics.COMMITS.labels(*labels)
        self._commits_ahead = metrics.COMMITS_AHEAD.labels(*labels)
        self._batch = metrics.COMMIT_BATCH.labels(*labels)
        self._commit_seconds = metrics.COMMIT_SECONDS.labels(*labels)
        self.bytes_in = metrics.BYTES_IN.labels(*labels)
        self.bytes_out = metrics.BYTES_OUT.labels(*labels)
        self.purged = metrics.PURGED.labels(*labels)
        self.committer = GroupCommitter(
            environment,
            self.context,
            thread=writers.assign(),
            on_commit=self._on_commit,
            replicated=self._wait_replicated if replicated else None,
        )

    def context(self) -> ShardContext:
        return ShardContext(self.queue.config, self.index, self.epoch)

    def is_local_leader(self) -> bool:
        return self.replica is None or self.replica.is_serving()

    def require_leader(self) -> None:
        if self.replica is not None:
            self.replica.require_serving()

    async def _wait_replicated(self, index: int, epoch: int) -> None:
        if self.replica is not None:
            await self.replica.wait_committed(index, epoch)

    def replace_environment(self, environment: ShardEnvironment) -> None:
        self.environment = environment
        # The swap ran through run_exclusive, which already forgot what counted as replicated.
        self.committer.environment = environment
        with environment.read() as tx:
            self.last_written_index = tx.last_index()

    def _on_commit(self, report: CommitReport) -> None:
        if report.log_index:
            self._commits.inc()
            if report.written_ahead:
                self._commits_ahead.inc()
            self._batch.observe(report.requests)
            self._commit_seconds.observe(report.seconds)
            self.last_written_index = report.log_index
            if self.replica is not None:
                self.replica.note_local_commit(report.log_index)
        self._count_load(report.requests)
        self.queue.wake()

    def _count_load(self, requests: int) -> None:
        self._load_requests += requests
        elapsed = time.monotonic() - self._load_window_started
        if elapsed >= LOAD_WINDOW_S:
            self._load = self._load_requests / elapsed
            self._load_requests = 0
            self._load_window_started = time.monotonic()

    def load_per_second(self) -> float:
        """Requests per second over the last load window (leadership moves use it)."""
        if time.monotonic() - self._load_window_started > 2 * LOAD_WINDOW_S:
            return 0.0
        return self._load

    def message_count(self) -> int:
        with self.environment.read() as tx:
            return tx.message_count()

    def next_visible_at(self) -> int | None:
        if self.committer.answered_uncommitted:
            # A send answered before its LMDB commit (commit ahead) is not in read
            # transactions yet: "now", so that a receive asks the writer, queued behind it.
            return 0
        with self.environment.read() as tx:
            return tx.next_visible_at()

    def stats(self) -> ShardStats:
        return self.environment.stats(now_ms=wall_clock_ms())

    def report(self) -> metrics.ShardReport:
        """What this replica says about itself on /metrics (depth only where it leads)."""
        leading = self.is_local_leader()
        stats = None
        if leading:
            with contextlib.suppress(EnvironmentClosed):  # replaced or shutting down: no depth now
                stats = self.stats()
        replica = self.replica
        if replica is None:
            return metrics.ShardReport(
                queue=self.queue.config.name,
                shard=self.index,
                leader=True,
                epoch=self.epoch,
                commit_index=self.last_written_index,
                stats=stats,
                replicas=1,
            )
        return metrics.ShardReport(
            queue=self.queue.config.name,
            shard=self.index,
            leader=leading,
            epoch=self.epoch,
            commit_index=replica.commit_index,
            stats=stats,
            replicas=len(replica.replicas),
            in_sync_replicas=len(replica.isr) if leading else None,
            follower_lag=replica.follower_lag() if leading else {},
        )

    def count_rejections(self, reasons: Iterable[Reason | None]) -> None:
        for reason in reasons:
            if reason is not None:
                metrics.REJECTED_RECEIPTS.labels(self.queue.config.name, str(self.index), reason.value).inc()
