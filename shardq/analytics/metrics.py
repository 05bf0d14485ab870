"""The report's numbers, computed in Spark from the journal and the lifecycles.

Each `compute_*` returns a small DataFrame (at most a few thousand rows) that
the report writes as Parquet and collects for plotting.
"""

from __future__ import annotations

import dataclasses

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as sf

from shardq.analytics.lifecycles import Outcome

# Throughput plots read best with about this many points.
TARGET_THROUGHPUT_BUCKETS = 120
_NICE_BUCKET_SECONDS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)

# percentile_approx relative error is 1/accuracy: 1e-4 of the latency range.
_PERCENTILE_ACCURACY = 10_000
# The latency curve: every percent, plus the tail.
LATENCY_CURVE_PERCENTILES = (*(p / 100 for p in range(100)), 0.995, 0.999, 1.0)

THROUGHPUT_EVENT_TYPES = ("SENT", "RECEIVED", "DELETED", "DEAD_LETTERED", "EXPIRED")


def choose_bucket_seconds(span_seconds: float) -> int:
    """The smallest round bucket that cuts `span_seconds` into at most ~120 buckets."""
    wanted = span_seconds / TARGET_THROUGHPUT_BUCKETS
    for seconds in _NICE_BUCKET_SECONDS:
        if seconds >= wanted:
            return seconds
    return _NICE_BUCKET_SECONDS[-1]


def compute_throughput(journal: DataFrame, *, bucket_seconds: int) -> DataFrame:
    """Events per time bucket and type: bucket_start, event_type, events, events_per_second."""
    bucket_start = sf.timestamp_seconds(
        sf.floor(sf.unix_micros("event_time") / (bucket_seconds * 1_000_000)) * bucket_seconds
    )
    return (
        journal.where(sf.col("event_type").isin(*THROUGHPUT_EVENT_TYPES))
        .groupBy(bucket_start.alias("bucket_start"), "event_type")
        .agg(sf.count(sf.lit(1)).alias("events"))
        .withColumn("events_per_second", sf.col("events") / sf.lit(float(bucket_seconds)))
        .orderBy("bucket_start", "event_type")
    )


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyStats:
    """End-to-end latency (sent -> deleted) of the deleted messages, in ms."""

    messages: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    # (percentile in [0, 1], latency ms) along the whole distribution, for the plot.
    curve: tuple[tuple[float, float], ...]


def compute_latency(lifecycles: DataFrame) -> LatencyStats:
    deleted = lifecycles.where(sf.col("latency_ms").isNotNull())
    row = deleted.agg(
        sf.count(sf.lit(1)).alias("messages"),
        sf.mean("latency_ms").alias("mean_ms"),
        sf.max("latency_ms").alias("max_ms"),
        sf.percentile_approx("latency_ms", list(LATENCY_CURVE_PERCENTILES), _PERCENTILE_ACCURACY).alias("curve"),
    ).collect()[0]
    if row["messages"] == 0:
        return LatencyStats(0, None, None, None, None, None, ())
    curve = tuple(zip(LATENCY_CURVE_PERCENTILES, (float(v) for v in row["curve"]), strict=True))
    at = dict(curve)
    return LatencyStats(
        messages=row["messages"],
        mean_ms=float(row["mean_ms"]),
        p50_ms=at[0.5],
        p90_ms=at[0.9],
        p99_ms=at[0.99],
        # The exact maximum, not the approximate 100th percentile.
        max_ms=float(row["max_ms"]),
        curve=curve,
    )


def compute_receive_counts(lifecycles: DataFrame) -> DataFrame:
    """How many deliveries messages needed, by outcome: receive_count, outcome, messages."""
    return (
        lifecycles.groupBy(sf.coalesce(sf.col("receive_count"), sf.lit(0)).alias("receive_count"), "outcome")
        .agg(sf.count(sf.lit(1)).alias("messages"))
        .orderBy("receive_count", "outcome")
    )


def compute_dead_letters(journal: DataFrame) -> DataFrame:
    """Messages dead-lettered out of this queue, by reason: reason, messages."""
    return (
        journal.where(sf.col("event_type") == "DEAD_LETTERED")
        .groupBy(sf.coalesce(sf.col("reason"), sf.lit("unknown")).alias("reason"))
        .agg(sf.countDistinct("message_id").alias("messages"))
        .orderBy(sf.desc("messages"), "reason")
    )


def compute_shard_load(journal: DataFrame) -> DataFrame:
    """Per shard: sent, received, deleted, dead_lettered, expired, bytes_sent, events."""

    def count_of(event_type: str) -> Column:
        return sf.sum(sf.when(sf.col("event_type") == event_type, 1).otherwise(0))

    return (
        journal.groupBy("shard")
        .agg(
            count_of("SENT").alias("sent"),
            count_of("RECEIVED").alias("received"),
            count_of("DELETED").alias("deleted"),
            count_of("DEAD_LETTERED").alias("dead_lettered"),
            count_of("EXPIRED").alias("expired"),
            sf.sum(sf.when(sf.col("event_type") == "SENT", sf.col("size")).otherwise(0)).alias("bytes_sent"),
            sf.count(sf.lit(1)).alias("events"),
        )
        .orderBy("shard")
    )


def count_outcomes(lifecycles: DataFrame) -> dict[str, int]:
    counts = dict.fromkeys(
        (Outcome.DELETED, Outcome.DEAD_LETTERED, Outcome.EXPIRED, Outcome.PURGED, Outcome.PENDING), 0
    )
    for row in lifecycles.groupBy("outcome").count().collect():
        counts[row["outcome"]] = row["count"]
    return counts


# What ends a message's wait in the queue, for the backlog over time (a dead-lettered
# message waits no more, even before its copy reaches the DLQ), as in the lifecycles.
_REMOVING_EVENTS = ("DELETED", "EXPIRED", "DEAD_LETTERED")


def compute_backlog(journal: DataFrame, lifecycles: DataFrame, *, bucket_seconds: int) -> DataFrame:
    """Per time bucket: backlog (messages waiting at the bucket's end: sent, and not yet
    deleted, dead-lettered, expired or purged; counted from the start of the range
    read) and oldest_age_seconds (age of the oldest of them then).

    Columns: bucket_end, backlog, oldest_age_seconds (null when empty).
    """
    bucket_start = sf.timestamp_seconds(
        sf.floor(sf.unix_micros("event_time") / (bucket_seconds * 1_000_000)) * bucket_seconds
    )
    change = (
        sf.when(sf.col("event_type") == "SENT", sf.lit(1))
        .when(sf.col("event_type").isin(*_REMOVING_EVENTS), sf.lit(-1))
        .when(sf.col("event_type") == "PURGED", -sf.coalesce(sf.col("purged_count"), sf.lit(0)))
        .otherwise(sf.lit(0))
    )
    per_bucket = journal.groupBy(bucket_start.alias("bucket_start")).agg(sf.sum(change).alias("change"))
    bounds = per_bucket.agg(sf.min("bucket_start").alias("first"), sf.max("bucket_start").alias("last")).collect()[0]
    if bounds["first"] is None:
        return journal.sparkSession.createDataFrame([], "bucket_end timestamp, backlog long, oldest_age_seconds double")
    spark = journal.sparkSession
    first_micros = int(bounds["first"].timestamp() * 1_000_000)
    last_micros = int(bounds["last"].timestamp() * 1_000_000)
    step = bucket_seconds * 1_000_000
    buckets = spark.createDataFrame(
        [(micros,) for micros in range(first_micros, last_micros + step, step)], "start_micros long"
    ).select(sf.timestamp_micros("start_micros").alias("bucket_start"))
    running = Window.orderBy("bucket_start").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    backlog = (
        buckets.join(per_bucket, "bucket_start", "left")
        .withColumn("backlog", sf.sum(sf.coalesce(sf.col("change"), sf.lit(0))).over(running))
        .withColumn("bucket_end", sf.timestamp_micros(sf.unix_micros("bucket_start") + step))
        .select("bucket_end", "backlog")
    )
    ended = sf.coalesce(sf.col("deleted_at"), sf.col("dead_lettered_at"), sf.col("expired_at"), sf.col("purged_at"))
    alive = lifecycles.select("sent_at", ended.alias("ended_at")).where(sf.col("sent_at").isNotNull())
    # At most ~120 bucket ends against every message: a nested-loop join Spark broadcasts.
    oldest = (
        sf.broadcast(backlog.select("bucket_end"))
        .join(
            alive,
            (sf.col("sent_at") <= sf.col("bucket_end"))
            & (sf.col("ended_at").isNull() | (sf.col("ended_at") > sf.col("bucket_end"))),
        )
        .groupBy("bucket_end")
        .agg(sf.min("sent_at").alias("oldest_sent_at"))
    )
    return (
        backlog.join(oldest, "bucket_end", "left")
        .withColumn(
            "oldest_age_seconds",
            (sf.unix_micros("bucket_end") - sf.unix_micros("oldest_sent_at")) / sf.lit(1_000_000.0),
        )
        .select("bucket_end", "backlog", "oldest_age_seconds")
        .orderBy("bucket_end")
    )


@dataclasses.dataclass(frozen=True, slots=True)
class WaitAndProcessing:
    """Of the deleted messages: waiting (sent -> first received) and processing
    (last received -> deleted) time, as (percentile, ms) curves."""

    messages: int
    wait_curve: tuple[tuple[float, float], ...]
    processing_curve: tuple[tuple[float, float], ...]


def compute_wait_and_processing(lifecycles: DataFrame) -> WaitAndProcessing:
    deleted = lifecycles.where(sf.col("deleted_at").isNotNull() & sf.col("first_received_at").isNotNull())
    wait = sf.unix_millis("first_received_at") - sf.unix_millis("sent_at")
    processing = sf.unix_millis("deleted_at") - sf.unix_millis("last_received_at")
    row = deleted.agg(
        sf.count(sf.lit(1)).alias("messages"),
        sf.percentile_approx(wait, list(LATENCY_CURVE_PERCENTILES), _PERCENTILE_ACCURACY).alias("wait"),
        sf.percentile_approx(processing, list(LATENCY_CURVE_PERCENTILES), _PERCENTILE_ACCURACY).alias("processing"),
    ).collect()[0]
    if row["messages"] == 0:
        return WaitAndProcessing(0, (), ())
    return WaitAndProcessing(
        messages=row["messages"],
        wait_curve=tuple(zip(LATENCY_CURVE_PERCENTILES, (float(v) for v in row["wait"]), strict=True)),
        processing_curve=tuple(zip(LATENCY_CURVE_PERCENTILES, (float(v) for v in row["processing"]), strict=True)),
    )
