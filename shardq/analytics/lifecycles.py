"""The journal folded into one row per message: when it was sent, received,
deleted or dead-lettered, and how long it took from send to delete.

Every journal event of a message carries its `sent_at`, so a lifecycle knows
its send time even when the SENT event itself is outside the range read.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as sf


class Outcome:
    """The `outcome` column: what finally happened to the message (str values)."""

    DELETED = "deleted"
    DEAD_LETTERED = "dead_lettered"
    EXPIRED = "expired"
    # Removed by a purge of its shard: a PURGED event carries only a count, so a
    # message is purged when a purge of its shard came after it was sent and
    # nothing else had ended it.
    PURGED = "purged"
    PENDING = "pending"


def _first_time_of(event_type: str) -> Column:
    return sf.min(sf.when(sf.col("event_type") == event_type, sf.col("event_time")))


def build_message_lifecycles(journal: DataFrame) -> DataFrame:
    """One row per (queue, message_id) seen in `journal` (a `read=journal` frame).

    Columns: queue, shard, seq, message_id, group_id, size, source_queue,
    sent_at, first_received_at, last_received_at, deleted_at, expired_at,
    dead_lettered_at, dead_letter_reason, purged_at, receive_count, outcome,
    latency_ms (sent -> deleted, null unless deleted).
    """
    received = sf.col("event_type") == "RECEIVED"
    per_message = (
        journal.where(sf.col("message_id").isNotNull())
        .groupBy("queue", "message_id")
        .agg(
            sf.min("shard").alias("shard"),
            sf.max("seq").alias("seq"),
            sf.max("group_id").alias("group_id"),
            sf.max("size").alias("size"),
            sf.max(sf.when(sf.col("event_type") == "SENT", sf.col("source_queue"))).alias("source_queue"),
            sf.min(sf.coalesce(sf.col("sent_at"), sf.when(sf.col("event_type") == "SENT", sf.col("event_time")))).alias(
                "sent_at"
            ),
            sf.min(sf.when(received, sf.col("event_time"))).alias("first_received_at"),
            sf.max(sf.when(received, sf.col("event_time"))).alias("last_received_at"),
            _first_time_of("DELETED").alias("deleted_at"),
            _first_time_of("EXPIRED").alias("expired_at"),
            _first_time_of("DEAD_LETTERED").alias("dead_lettered_at"),
            sf.max(sf.when(sf.col("event_type") == "DEAD_LETTERED", sf.col("reason"))).alias("dead_letter_reason"),
            sf.max("receive_count").alias("receive_count"),
        )
    )
    purges = (
        journal.where(sf.col("event_type") == "PURGED")
        .select(
            sf.col("queue").alias("purge_queue"),
            sf.col("shard").alias("purge_shard"),
            sf.col("event_time").alias("purge_time"),
        )
        .distinct()
    )
    # The first purge of the message's shard after it was sent (purges are rare: a
    # small side of the join).
    with_purges = (
        per_message.join(
            sf.broadcast(purges),
            (sf.col("queue") == sf.col("purge_queue"))
            & (sf.col("shard") == sf.col("purge_shard"))
            & (sf.col("purge_time") >= sf.col("sent_at")),
            "left",
        )
        .groupBy(*per_message.columns)
        .agg(sf.min("purge_time").alias("purged_at"))
    )
    return with_purges.withColumn(
        "outcome",
        sf.when(sf.col("deleted_at").isNotNull(), sf.lit(Outcome.DELETED))
        .when(sf.col("dead_lettered_at").isNotNull(), sf.lit(Outcome.DEAD_LETTERED))
        .when(sf.col("expired_at").isNotNull(), sf.lit(Outcome.EXPIRED))
        .when(sf.col("purged_at").isNotNull(), sf.lit(Outcome.PURGED))
        .otherwise(sf.lit(Outcome.PENDING)),
    ).withColumn(
        "latency_ms",
        sf.when(
            sf.col("deleted_at").isNotNull(),
            sf.unix_millis(sf.col("deleted_at")) - sf.unix_millis(sf.col("sent_at")),
        ),
    )
