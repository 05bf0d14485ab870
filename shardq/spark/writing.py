"""`df.write.format("shardq")`: bulk sends with deterministic dedup ids.

Every row gets a dedup id that depends only on (write id, Spark partition id,
row index within the partition), unless the row brings its own `dedup_id`.
A retried task therefore re-sends the same ids, and the queue's dedup window
turns every repeat into a no-op (the server answers duplicate=true). Sends are
not transactional: rows a failed job had already sent stay in the queue, and
running the job again with the same `writeId` within the dedup window sends
only the rest. Generated ids are only as stable as the input's partitioning:
when it is not deterministic (e.g. after an unordered shuffle), give each row
a `dedup_id` of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import (
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
)

from shardq.errors import QueueFull, Reason
from shardq.spark.options import OptionError, WriteOptions

if TYPE_CHECKING:
    from shardq import Client, Message

logger = logging.getLogger(__name__)

# Waits between re-sends of entries a full shard refused (no retry-after comes with them).
_FIRST_BACKOFF_SECONDS = 0.05
_MAX_BACKOFF_SECONDS = 2.0

# Column name -> the Spark types accepted for it. Only `body` is required.
WRITE_COLUMNS: dict[str, tuple[DataType, ...]] = {
    "body": (BinaryType(), StringType()),
    "attributes": (MapType(StringType(), StringType(), True), MapType(StringType(), StringType(), False)),
    "group_id": (StringType(),),
    "dedup_id": (StringType(),),
    "delay_ms": (LongType(), IntegerType()),
    "priority": (IntegerType(), LongType()),
}


def validate_write_schema(schema: StructType) -> None:
    names = schema.fieldNames()
    if "body" not in names:
        raise OptionError(f"writing to shardq needs a 'body' column (binary or string); got columns {names}")
    for field in schema.fields:
        accepted = WRITE_COLUMNS.get(field.name)
        if accepted is None:
            raise OptionError(f"column {field.name!r} cannot be written to shardq; columns are {sorted(WRITE_COLUMNS)}")
        if field.dataType not in accepted:
            raise OptionError(
                f"column {field.name!r} has type {field.dataType.simpleString()}, expected one of "
                f"{[t.simpleString() for t in accepted]}"
            )


def compute_dedup_id(*, write_id: str, partition_id: int, row_index: int) -> str:
    digest = hashlib.sha256(f"{write_id}\x00{partition_id}\x00{row_index}".encode()).hexdigest()
    return f"spark-{digest[:40]}"


def build_messages(batch: pa.RecordBatch, *, write_id: str, partition_id: int, first_row_index: int) -> list[Message]:
    from shardq import Message

    columns = {name: batch.column(name).to_pylist() for name in batch.schema.names}
    count = batch.num_rows
    bodies: list[bytes | str | None] = columns["body"]
    attributes: list[list[tuple[str, str]] | None] = columns.get("attributes", [None] * count)
    group_ids: list[str | None] = columns.get("group_id", [None] * count)
    dedup_ids: list[str | None] = columns.get("dedup_id", [None] * count)
    delays: list[int | None] = columns.get("delay_ms", [None] * count)
    priorities: list[int | None] = columns.get("priority", [None] * count)
    messages = []
    for offset in range(count):
        body = bodies[offset]
        if body is None:
            raise ValueError(f"row {first_row_index + offset} of partition {partition_id} has a null body")
        dedup_id = dedup_ids[offset] or compute_dedup_id(
            write_id=write_id, partition_id=partition_id, row_index=first_row_index + offset
        )
        messages.append(
            Message(
                body=body.encode() if isinstance(body, str) else body,
                attributes=dict(attributes[offset] or ()),
                group_id=group_ids[offset] or "",
                dedup_id=dedup_id,
                delay_ms=delays[offset],
                priority=priorities[offset] or 0,
            )
        )
    return messages


@dataclasses.dataclass(frozen=True)
class SendCommitMessage(WriterCommitMessage):
    partition_id: int
    sent: int
    # Rows the queue had already stored under the same dedup id: a retry's repeats.
    duplicates: int


class ShardqArrowWriter(DataSourceArrowWriter):
    def __init__(self, options: WriteOptions) -> None:
        self._options = options
        # Chosen once, on the driver: this object is pickled into every task,
        # so all tasks and their retries share it.
        self._write_id = options.write_id or uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SendCommitMessage:
        from shardq import Client

        context = TaskContext.get()
        partition_id = context.partitionId() if context is not None else 0
        sent = duplicates = 0
        row_index = 0
        client = Client(self._options.endpoint)
        try:
            pending: list[Message] = []
            for batch in iterator:
                pending.extend(
                    build_messages(batch, write_id=self._write_id, partition_id=partition_id, first_row_index=row_index)
                )
                row_index += batch.num_rows
                size = self._options.send_batch_size
                whole_chunks = len(pending) - len(pending) % size
                for begin in range(0, whole_chunks, size):
                    duplicates += self._send(client, pending[begin : begin + size])
                sent += whole_chunks
                del pending[:whole_chunks]
            if pending:
                duplicates += self._send(client, pending)
                sent += len(pending)
        finally:
            client.close()
        return SendCommitMessage(partition_id=partition_id, sent=sent, duplicates=duplicates)

    def _send(self, client: Client, messages: Sequence[Message]) -> int:
        """Sends one chunk; returns how many were duplicates.

        A full queue (the whole request refused, or some shards' entries) is
        waited out, up to `queueFullPatienceSeconds`: re-sending is safe, the
        dedup ids stay the same. Any other refusal fails the task.
        """
        deadline = time.monotonic() + self._options.queue_full_patience_seconds
        remaining = list(messages)
        duplicates = 0
        backoff_seconds = _FIRST_BACKOFF_SECONDS
        while True:
            try:
                results = client.send_messages(self._options.queue, remaining)
            except QueueFull as full:
                # The server says when the queue will have room again.
                wait_seconds = max(full.retry_after_ms / 1000, _FIRST_BACKOFF_SECONDS)
            else:
                duplicates += sum(1 for result in results if result.ok and result.duplicate)
                refused = [(m, r) for m, r in zip(remaining, results, strict=True) if not r.ok]
                if not refused:
                    return duplicates
                other = [r for _, r in refused if r.error_reason != Reason.QUEUE_FULL.value]
                if other:
                    raise RuntimeError(
                        f"{len(other)} of {len(results)} messages were refused by {self._options.queue!r}; "
                        f"first: {other[0].error_reason}: {other[0].error_message}"
                    )
                remaining = [message for message, _ in refused]
                wait_seconds = backoff_seconds
                backoff_seconds = min(backoff_seconds * 2, _MAX_BACKOFF_SECONDS)
            if time.monotonic() + wait_seconds > deadline:
                raise RuntimeError(
                    f"queue {self._options.queue!r} stayed full for {self._options.queue_full_patience_seconds}s "
                    f"({len(remaining)} messages of this chunk unsent); a retry of the task re-sends them "
                    "with the same dedup ids"
                )
            time.sleep(wait_seconds)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        # Every send was acknowledged durably as it happened; nothing is left to publish.
        sent = sum(m.sent for m in messages if isinstance(m, SendCommitMessage))
        duplicates = sum(m.duplicates for m in messages if isinstance(m, SendCommitMessage))
        logger.info(
            "shardq write %s to %r: %d rows sent, %d already stored",
            self._write_id,
            self._options.queue,
            sent,
            duplicates,
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        # Sent rows cannot be taken back; a rerun with the same writeId skips them.
        logger.warning(
            "shardq write %s to %r aborted; rows already sent stay in the queue. Rerun with "
            "option writeId=%s within the dedup window to send only the rest.",
            self._write_id,
            self._options.queue,
            self._write_id,
        )
