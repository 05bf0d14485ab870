"""Spark data source "shardq": read a queue's messages and journal, write rows as messages.

Importing this package does not import pyspark; `register` does. Nothing here
receives, acknowledges or deletes a message: reads go through the read-only
ExportService (proto/shardq/v1/export.proto).

    import shardq.spark
    shardq.spark.register(spark)          # spark.dataSource.register(...)
    messages = (spark.read.format("shardq")
                .option("endpoint", "shardq.queues.svc:7400").option("queue", "orders")
                .option("read", "messages").load())

Reading (`spark.read` / `spark.readStream`), one partition per shard
----------------------------------------------------------------------
Options (case-insensitive):

=====================  ==========================================================
endpoint               host:port of any shardq server (required)
queue                  queue name (required)
read                   ``messages`` (default): a consistent snapshot of each shard's
                       stored messages; ``journal``: lifecycle events
includeBody            ``true`` to fill the ``body`` column of ``read=messages``
                       (default ``false``: bodies stay on the server)
batchSize              rows per streamed gRPC batch and Arrow batch (default 1000)
startingOffsets        journal: ``earliest`` (default), ``latest``, or JSON offsets
                       ``{"0": 17, "1": 5}`` (shard -> next log index to read)
maxRowsPerBatch        streaming: at most this many events per micro-batch, shared
                       fairly between shards (a single log index is never split)
failOnDataLoss         journal: fail (default ``true``) when entries still to be
                       read fell out of journal retention; ``false`` skips them
rpcTimeoutSeconds      deadline of unary calls (default 30)
retrySeconds           how long a read keeps trying while a server is unreachable or
                       shutting down, or a shard has no leader (default 60; 0: fail
                       at once). A journal read that breaks resumes after its last
                       batch; a snapshot that breaks midway fails its task, and
                       Spark's task retry reads that shard's snapshot again
=====================  ==========================================================

A batch journal read covers each shard up to its last log index at planning
time. A streaming journal read checkpoints per-shard offsets
``{"<shard>": <next log index>}``, supports ``Trigger.AvailableNow`` and
``maxRowsPerBatch`` admission control, and reports each shard's latest
offset (``latestOffset`` in the query progress) so lag is visible.
Streaming over ``read=messages`` is refused: a snapshot has no offsets.

Schema of ``read=messages`` (one row per message stored when the shard's
snapshot was taken; deleted messages are gone, see the journal for them):

=====================  ===================  ========================================
queue                  string not null      queue name
shard                  int not null         shard number
seq                    bigint not null      sequence number within the shard
message_id             string not null      time-ordered unique id
state                  string not null      VISIBLE, IN_FLIGHT, DELAYED, DEAD_LETTER_PENDING
sent_at                timestamp            when it was sent
first_received_at      timestamp            first delivery; null if never received
last_received_at       timestamp            latest delivery; null if never received
visible_at             timestamp            when it becomes (or became) deliverable
receive_count          int not null         deliveries so far
size                   int not null         body size in bytes
attributes             map<string,string>   message attributes
group_id               string               FIFO group; null if none
dedup_id               string               dedup id given at send; null if none
body                   binary               the body with ``includeBody=true``, else null
snapshot_log_index     bigint not null      last log index the snapshot includes
=====================  ===================  ========================================

Schema of ``read=journal`` (one row per lifecycle event; several events can
share a log index):

=====================  ===================  ========================================
queue                  string not null      queue name
shard                  int not null         shard number
log_index              bigint not null      log entry of the event (from 1, +1 per entry)
epoch                  bigint not null      leader epoch that wrote it
event_time             timestamp not null   when it happened
event_type             string not null      SENT, RECEIVED, DELETED, VISIBILITY_CHANGED,
                                            RELEASED, EXPIRED, DEAD_LETTERED,
                                            DEAD_LETTER_DELIVERED, PURGED
seq                    bigint               message's sequence number (null for PURGED)
message_id             string               joins the events of one message (null for PURGED)
sent_at                timestamp            when the message was sent
size                   int                  SENT: body size in bytes; null on other events
receive_count          int                  deliveries so far, as of this event; null on
                                            DELETED, EXPIRED, DEAD_LETTER_DELIVERED and
                                            PURGED, which do not carry it
visible_at             timestamp            RECEIVED / VISIBILITY_CHANGED / RELEASED:
                                            when it becomes visible again
group_id               string               SENT: FIFO group; null if none
reason                 string               DEAD_LETTERED: why: max_receive_count, or rejected (its consumer sent it)
source_queue           string               SENT into a dead-letter queue or by a redrive:
                                            the queue it came from
purged_count           bigint               PURGED: messages removed
=====================  ===================  ========================================

The delete time of a message is the ``event_time`` of its DELETED event;
``shardq.analytics.lifecycles`` folds the journal into one row per message
(sent / first receive / last receive / delete times, receive count,
dead-letter reason and source queue).

Writing (`df.write.format("shardq").mode("append")`)
----------------------------------------------------
Columns: ``body`` (binary or string, required), ``attributes``
(map<string,string>), ``group_id`` (string, FIFO queues), ``dedup_id``
(string), ``delay_ms`` (bigint), ``priority`` (int, on a queue with priority
lanes). Options: ``endpoint``, ``queue``,
``batchSize`` (messages per SendMessages, default 100), ``writeId``,
``queueFullPatienceSeconds`` (default 60). Rows without a ``dedup_id`` get
one derived from (``writeId``, partition id, row index), so a retried task's
repeats are deduplicated by the queue; pass the same ``writeId`` to make a
rerun of a whole job a no-op for rows already sent within the dedup window.
See `shardq.spark.writing` for the limits of that guarantee.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

FORMAT_NAME = "shardq"

__all__ = ["FORMAT_NAME", "register"]


def register(spark: SparkSession) -> None:
    """Make `spark.read.format("shardq")` and friends available in this session."""
    from shardq.spark.source import ShardqDataSource

    spark.dataSource.register(ShardqDataSource)
