"""Batch and streaming readers: one Spark partition per shard, Arrow batches out.

Planning (partitions, offsets) runs on the driver and asks the server for
journal bounds; `read` runs in the tasks, opens its own connection, and streams
one shard. A journal partition carries a fixed [from, to) range of log
indexes, so a retried task reads exactly the same events again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from shardq.spark.batches import journal_batch_from_proto, message_batch_from_proto
from shardq.spark.exporting import (
    ExportConnection,
    journal_end_index,
    journal_start_index,
)
from shardq.spark.offsets import (
    ShardBacklog,
    ShardOffsets,
    compute_bounded_latest,
    compute_capped_end,
    compute_start_offsets,
    offsets_from_json,
    offsets_to_json,
)
from shardq.spark.options import ReadKind, ReadOptions, StartingPosition

logger = logging.getLogger(__name__)


class DataLossError(RuntimeError):
    """Journal entries a query still had to read fell out of journal retention."""


class MessagesPartition(InputPartition):
    def __init__(self, shard: int) -> None:
        super().__init__(shard)
        self.shard = shard


class JournalPartition(InputPartition):
    def __init__(self, shard: int, from_index: int, to_index: int) -> None:
        super().__init__(shard)
        self.shard = shard
        self.from_index = from_index
        self.to_index = to_index


def connect(options: ReadOptions) -> ExportConnection:
    return ExportConnection(
        options.endpoint, rpc_timeout_seconds=options.rpc_timeout_seconds, retry_seconds=options.retry_seconds
    )


def read_messages_partition(options: ReadOptions, partition: MessagesPartition) -> Iterator[pa.RecordBatch]:
    with connect(options) as connection:
        for batch in connection.message_batches(
            queue=options.queue,
            shard=partition.shard,
            include_body=options.include_body,
            batch_size=options.export_batch_size,
        ):
            if batch.messages:
                yield message_batch_from_proto(
                    options.queue,
                    batch.messages,
                    snapshot_log_index=batch.snapshot_log_index,
                    include_body=options.include_body,
                )


def read_journal_partition(options: ReadOptions, partition: JournalPartition) -> Iterator[pa.RecordBatch]:
    if partition.to_index <= partition.from_index:
        return
    with connect(options) as connection:
        for batch in connection.journal_batches(
            queue=options.queue,
            shard=partition.shard,
            from_index=partition.from_index,
            to_index=partition.to_index,
            batch_size=options.export_batch_size,
        ):
            if batch.events:
                yield journal_batch_from_proto(options.queue, batch.events)


def plan_journal_partitions(
    *, start: Mapping[int, int], end: Mapping[int, int], first_indexes: Mapping[int, int], fail_on_data_loss: bool
) -> list[InputPartition]:
    """One partition per shard with something to read, clamped to what is retained."""
    partitions: list[InputPartition] = []
    for shard in sorted(end):
        from_index = start.get(shard, first_indexes.get(shard, 1))
        retained_from = first_indexes.get(shard, from_index)
        if from_index < retained_from:
            message = (
                f"shard {shard}: log indexes {from_index}..{retained_from - 1} fell out of journal "
                "retention before they were read"
            )
            if fail_on_data_loss:
                raise DataLossError(message + " (set failOnDataLoss=false to skip them)")
            logger.warning("%s; skipping them", message)
            from_index = retained_from
        if end[shard] > from_index:
            partitions.append(JournalPartition(shard, from_index, end[shard]))
    return partitions


class ShardqBatchReader(DataSourceReader):
    def __init__(self, options: ReadOptions) -> None:
        self._options = options

    def partitions(self) -> list[InputPartition]:
        options = self._options
        with connect(options) as connection:
            if options.read is ReadKind.MESSAGES:
                return [MessagesPartition(shard) for shard in range(connection.shard_count(options.queue))]
            bounds = connection.all_journal_bounds(options.queue)
        first_indexes = {shard: journal_start_index(b) for shard, b in bounds.items()}
        # The end is fixed here, at planning, so every task reads a stable range.
        end = {shard: journal_end_index(b) for shard, b in bounds.items()}
        start = _resolve_starting(options, first_indexes=first_indexes, end=end)
        return plan_journal_partitions(
            start=start, end=end, first_indexes=first_indexes, fail_on_data_loss=options.fail_on_data_loss
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, MessagesPartition):
            return read_messages_partition(self._options, partition)
        if isinstance(partition, JournalPartition):
            return read_journal_partition(self._options, partition)
        raise TypeError(f"not a shardq partition: {partition!r}")


def _resolve_starting(
    options: ReadOptions, *, first_indexes: Mapping[int, int], end: Mapping[int, int]
) -> ShardOffsets:
    starting = options.starting
    if starting is StartingPosition.EARLIEST:
        return dict(first_indexes)
    if starting is StartingPosition.LATEST:
        return dict(end)
    return compute_start_offsets(starting, first_indexes)


def count_backlog(
    connection: ExportConnection,
    *,
    options: ReadOptions,
    shard: int,
    start: int,
    end: int,
    max_rows: int,
) -> ShardBacklog:
    """Events per log index from `start`, read until more than `max_rows` are
    counted and the log index in progress is complete (a shard alone can never
    be given more than `max_rows`, so counting further is wasted)."""
    groups: list[tuple[int, int]] = []
    counted = 0
    if end <= start:
        return ShardBacklog(start=start, end=end, groups=groups, complete=True)
    batches = connection.journal_batches(
        queue=options.queue, shard=shard, from_index=start, to_index=end, batch_size=options.export_batch_size
    )
    # Closing the generator early cancels the server's stream.
    with contextlib.closing(batches):
        for batch in batches:
            for event in batch.events:
                if groups and groups[-1][0] == event.log_index:
                    groups[-1] = (event.log_index, groups[-1][1] + 1)
                elif counted > max_rows:
                    return ShardBacklog(start=start, end=end, groups=groups, complete=False)
                else:
                    groups.append((event.log_index, 1))
                counted += 1
    return ShardBacklog(start=start, end=end, groups=groups, complete=True)


class ShardqJournalStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over the journal of every shard, with admission control.

    Lives in one driver-side process for the whole query, so it keeps one
    connection and the Trigger.AvailableNow target between calls.
    """

    def __init__(self, options: ReadOptions) -> None:
        self._options = options
        self._connection: ExportConnection | None = None
        self._available_now_target: ShardOffsets | None = None
        self._latest_seen: ShardOffsets | None = None

    def _open(self) -> ExportConnection:
        if self._connection is None:
            self._connection = connect(self._options)
        return self._connection

    def _fetch_bounds(self) -> tuple[ShardOffsets, ShardOffsets]:
        """(first retained index, exclusive end) of every shard, as of now."""
        bounds = self._open().all_journal_bounds(self._options.queue)
        first_indexes = {shard: journal_start_index(b) for shard, b in bounds.items()}
        latest = {shard: journal_end_index(b) for shard, b in bounds.items()}
        self._latest_seen = latest
        return first_indexes, latest

    def initialOffset(self) -> dict[str, int]:
        first_indexes, latest = self._fetch_bounds()
        return offsets_to_json(_resolve_starting(self._options, first_indexes=first_indexes, end=latest))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self._options.max_rows_per_batch is None:
            return ReadAllAvailable()
        return ReadMaxRows(self._options.max_rows_per_batch)

    def prepareForTriggerAvailableNow(self) -> None:
        _, latest = self._fetch_bounds()
        self._available_now_target = latest

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        first_indexes, latest = self._fetch_bounds()
        end = compute_bounded_latest(latest, self._available_now_target)
        # Entries that fell out of retention are not counted; `partitions` decides
        # whether losing them fails the query.
        begin = {
            shard: max(offset, first_indexes.get(shard, offset))
            for shard, offset in compute_start_offsets(offsets_from_json(start), first_indexes).items()
        }
        if isinstance(limit, ReadAllAvailable):
            # Never end before the start: Spark requires end >= start.
            return offsets_to_json({shard: max(last, begin.get(shard, last)) for shard, last in end.items()})
        if isinstance(limit, ReadMaxRows):
            connection = self._open()
            backlogs = {
                shard: count_backlog(
                    connection,
                    options=self._options,
                    shard=shard,
                    start=begin.get(shard, end[shard]),
                    end=end[shard],
                    max_rows=limit.max_rows,
                )
                for shard in end
            }
            return offsets_to_json(compute_capped_end(backlogs, limit.max_rows))
        raise ValueError(f"the shardq source supports no read limit of type {type(limit).__name__}")

    def reportLatestOffset(self) -> dict[str, int] | None:
        # Spark asks right after latestOffset; the bounds fetched there are fresh.
        latest = self._latest_seen if self._latest_seen is not None else self._fetch_bounds()[1]
        return offsets_to_json(latest)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        first_indexes, _ = self._fetch_bounds()
        return plan_journal_partitions(
            start=offsets_from_json(start),
            end=offsets_from_json(end),
            first_indexes=first_indexes,
            fail_on_data_loss=self._options.fail_on_data_loss,
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, JournalPartition):
            raise TypeError(f"not a shardq journal partition: {partition!r}")
        return read_journal_partition(self._options, partition)

    def commit(self, end: dict[str, int]) -> None:
        # Reading acknowledges nothing on the server: the checkpoint is the
        # only record of progress, so there is nothing to tell the queue.
        pass

    def stop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
