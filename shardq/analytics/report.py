"""The bundled analytics report: journal in, Parquet tables + PNG plots + HTML out.

    summary = run_report(endpoint="127.0.0.1:7400", queue="orders", out_dir=Path("report"))

Layout of `out_dir`:

    report.html              the page to open; links the plots below
    summary.json             the ReportSummary numbers
    plots/*.png              throughput, latency, receive_counts, dead_letters, shard_load
    parquet/<table>/         lifecycles (one row per message), throughput,
                             latency_percentiles, receive_counts, dead_letters, shard_load
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger(__name__)

PARQUET_TABLES = (
    "lifecycles",
    "throughput",
    "latency_percentiles",
    "receive_counts",
    "dead_letters",
    "shard_load",
    "backlog",
)
PLOTS = ("throughput", "backlog", "latency", "wait_vs_processing", "receive_counts", "dead_letters", "shard_load")


@dataclasses.dataclass(frozen=True)
class ReportSummary:
    queue: str
    shards: int
    # Journal events read (after `since`), and the time they span.
    events: int
    first_event_at: datetime.datetime | None
    last_event_at: datetime.datetime | None
    # Messages by what happened to them in the range read (lifecycle outcomes);
    # messages_sent counts SENT events.
    messages_sent: int
    messages_deleted: int
    messages_dead_lettered: int
    messages_expired: int
    messages_purged: int
    messages_pending: int
    # Messages received more than once.
    messages_redelivered: int
    sent_per_second: float | None
    latency_messages: int
    latency_mean_ms: float | None
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    dead_letters_by_reason: dict[str, int]
    out_dir: pathlib.Path
    report_html: pathlib.Path
    summary_json: pathlib.Path
    parquet: dict[str, pathlib.Path]
    plots: dict[str, pathlib.Path]

    def to_json_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        for key, value in values.items():
            if isinstance(value, datetime.datetime):
                values[key] = value.isoformat()
            elif isinstance(value, pathlib.Path):
                values[key] = str(value)
            elif isinstance(value, dict):
                values[key] = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in value.items()}
        return values


def _utc_from_micros(micros: int | None) -> datetime.datetime | None:
    if micros is None:
        return None
    return datetime.datetime.fromtimestamp(micros / 1_000_000, tz=datetime.UTC)


def read_journal(spark: SparkSession, *, endpoint: str, queue: str) -> DataFrame:
    import shardq.spark

    shardq.spark.register(spark)
    return (
        spark.read.format(shardq.spark.FORMAT_NAME)
        .option("endpoint", endpoint)
        .option("queue", queue)
        .option("read", "journal")
        .load()
    )


# Messages per Parquet file of the lifecycles table.
LIFECYCLES_PER_FILE = 2_000_000


def run_report(
    *,
    endpoint: str,
    queue: str,
    out_dir: pathlib.Path,
    spark: SparkSession | None = None,
    since: datetime.datetime | None = None,
) -> ReportSummary:
    """Read `queue`'s journal through `endpoint` and write the report to `out_dir`.

    Without `spark`, a session is created (local unless spark-submit says
    otherwise) and stopped at the end. `since` (timezone-aware) drops events
    before it; messages sent earlier still get their latency from the send
    time their later events carry.
    """
    from pyspark.sql import SparkSession

    own_session = spark is None
    session = spark if spark is not None else SparkSession.builder.appName(f"shardq-report-{queue}").getOrCreate()
    try:
        return _run_report(session, endpoint=endpoint, queue=queue, out_dir=out_dir, since=since)
    finally:
        if own_session:
            session.stop()


def _run_report(
    spark: SparkSession,
    *,
    endpoint: str,
    queue: str,
    out_dir: pathlib.Path,
    since: datetime.datetime | None,
) -> ReportSummary:
    from pyspark.sql import functions as sf

    from shardq.analytics import metrics, plotting
    from shardq.analytics.lifecycles import Outcome, build_message_lifecycles
    from shardq.analytics.rendering import format_number, format_timestamp, render_report_html
    from shardq.spark.exporting import ExportConnection

    out_dir = out_dir.resolve()
    plots_dir = out_dir / "plots"
    parquet_dir = out_dir / "parquet"
    plots_dir.mkdir(parents=True, exist_ok=True)

    with ExportConnection(endpoint, rpc_timeout_seconds=30.0) as connection:
        shards = connection.shard_count(queue)

    logger.info("reading the journal of %r (%d shards) from %s", queue, shards, endpoint)
    journal = read_journal(spark, endpoint=endpoint, queue=queue)
    if since is not None:
        journal = journal.where(sf.col("event_time") >= sf.lit(since))
    # Everything below reads the journal several times: fetch it from the shards once.
    journal = journal.cache()
    span = journal.agg(
        sf.count(sf.lit(1)).alias("events"),
        sf.min(sf.unix_micros("event_time")).alias("first"),
        sf.max(sf.unix_micros("event_time")).alias("last"),
        sf.sum(sf.when(sf.col("event_type") == "SENT", 1).otherwise(0)).alias("sent"),
    ).collect()[0]
    events = span["events"]
    first_event_at = _utc_from_micros(span["first"])
    last_event_at = _utc_from_micros(span["last"])
    messages_sent = span["sent"] or 0
    logger.info("read %d journal events", events)

    logger.info("folding events into message lifecycles")
    lifecycles = build_message_lifecycles(journal).cache()
    outcomes = metrics.count_outcomes(lifecycles)
    redelivered = lifecycles.where(sf.col("receive_count") > 1).count()

    span_seconds = 0.0
    if first_event_at is not None and last_event_at is not None:
        span_seconds = (last_event_at - first_event_at).total_seconds()
    bucket_seconds = metrics.choose_bucket_seconds(span_seconds)

    logger.info("computing throughput, latency, deliveries, dead letters and shard load")
    tables: dict[str, DataFrame] = {
        "lifecycles": lifecycles,
        "throughput": metrics.compute_throughput(journal, bucket_seconds=bucket_seconds),
        "receive_counts": metrics.compute_receive_counts(lifecycles),
        "dead_letters": metrics.compute_dead_letters(journal),
        "shard_load": metrics.compute_shard_load(journal),
        "backlog": metrics.compute_backlog(journal, lifecycles, bucket_seconds=bucket_seconds),
    }
    latency = metrics.compute_latency(lifecycles)
    waiting = metrics.compute_wait_and_processing(lifecycles)
    tables["latency_percentiles"] = spark.createDataFrame(
        [(float(p), float(ms)) for p, ms in latency.curve], "percentile double, latency_ms double"
    )

    parquet_paths = {}
    for name in PARQUET_TABLES:
        path = parquet_dir / name
        logger.info("writing %s", path)
        # Few, large files: every table but the lifecycles is small, and those get
        # a file per few million messages rather than one per Spark partition.
        files = max(1, -(-sum(outcomes.values()) // LIFECYCLES_PER_FILE)) if name == "lifecycles" else 1
        tables[name].coalesce(files).write.mode("overwrite").parquet(str(path))
        parquet_paths[name] = path

    throughput_points = [
        (_utc_from_micros(row["bucket_micros"]), row["event_type"], row["events_per_second"])
        for row in tables["throughput"]
        .select(sf.unix_micros("bucket_start").alias("bucket_micros"), "event_type", "events_per_second")
        .collect()
    ]
    receive_counts = [
        (row["receive_count"], row["outcome"], row["messages"]) for row in tables["receive_counts"].collect()
    ]
    dead_letters = {row["reason"]: row["messages"] for row in tables["dead_letters"].collect()}
    load_by_shard = {
        row["shard"]: (row["sent"], row["received"], row["deleted"], row["dead_lettered"], row["bytes_sent"])
        for row in tables["shard_load"].collect()
    }
    # Idle shards have no events but belong in the picture.
    shard_rows = [(shard, *load_by_shard.get(shard, (0, 0, 0, 0, 0))) for shard in range(shards)]

    logger.info("drawing plots into %s", plots_dir)
    plots = {
        "throughput": plotting.plot_throughput(
            [(start, kind, rate) for start, kind, rate in throughput_points if start is not None],
            bucket_seconds=bucket_seconds,
            path=plots_dir / "throughput.png",
        ),
        "backlog": plotting.plot_backlog(
            [
                (end, row["backlog"], row["oldest_age_seconds"])
                for row in tables["backlog"]
                .select(sf.unix_micros("bucket_end").alias("end_micros"), "backlog", "oldest_age_seconds")
                .collect()
                if (end := _utc_from_micros(row["end_micros"])) is not None
            ],
            path=plots_dir / "backlog.png",
        ),
        "latency": plotting.plot_latency(latency, path=plots_dir / "latency.png"),
        "wait_vs_processing": plotting.plot_wait_and_processing(
            waiting.messages, waiting.wait_curve, waiting.processing_curve, path=plots_dir / "wait_vs_processing.png"
        ),
        "receive_counts": plotting.plot_receive_counts(receive_counts, path=plots_dir / "receive_counts.png"),
        "dead_letters": plotting.plot_dead_letters(dead_letters, path=plots_dir / "dead_letters.png"),
        "shard_load": plotting.plot_shard_load(
            [(shard, sent, received, deleted) for shard, sent, received, deleted, _, _ in shard_rows],
            path=plots_dir / "shard_load.png",
        ),
    }

    sent_per_second = messages_sent / span_seconds if span_seconds > 0 else None
    summary = ReportSummary(
        queue=queue,
        shards=shards,
        events=events,
        first_event_at=first_event_at,
        last_event_at=last_event_at,
        messages_sent=messages_sent,
        messages_deleted=outcomes[Outcome.DELETED],
        messages_dead_lettered=outcomes[Outcome.DEAD_LETTERED],
        messages_expired=outcomes[Outcome.EXPIRED],
        messages_purged=outcomes[Outcome.PURGED],
        messages_pending=outcomes[Outcome.PENDING],
        messages_redelivered=redelivered,
        sent_per_second=sent_per_second,
        latency_messages=latency.messages,
        latency_mean_ms=latency.mean_ms,
        latency_p50_ms=latency.p50_ms,
        latency_p90_ms=latency.p90_ms,
        latency_p99_ms=latency.p99_ms,
        latency_max_ms=latency.max_ms,
        dead_letters_by_reason=dead_letters,
        out_dir=out_dir,
        report_html=out_dir / "report.html",
        summary_json=out_dir / "summary.json",
        parquet=parquet_paths,
        plots=plots,
    )

    page = render_report_html(
        title=f"shardq report: {queue}",
        subtitle=(
            f"{format_timestamp(first_event_at)} to {format_timestamp(last_event_at)}; "
            f"{events:,} journal events from {shards} shard(s) at {endpoint}"
        ),
        cards={
            "messages sent": format_number(messages_sent),
            "sent per second": format_number(sent_per_second),
            "deleted": format_number(summary.messages_deleted),
            "latency p50": format_number(latency.p50_ms, "ms"),
            "latency p99": format_number(latency.p99_ms, "ms"),
            "redelivered": format_number(redelivered),
            "dead-lettered": format_number(summary.messages_dead_lettered),
            "purged": format_number(summary.messages_purged),
            "still in queue": format_number(summary.messages_pending),
        },
        sections=[
            ("Throughput", plots["throughput"], [], []),
            ("Backlog and oldest message age", plots["backlog"], [], []),
            (
                "End-to-end latency (sent to deleted)",
                plots["latency"],
                ["messages", "mean", "p50", "p90", "p99", "max"],
                [
                    [
                        format_number(latency.messages),
                        *(
                            format_number(value, "ms")
                            for value in (
                                latency.mean_ms,
                                latency.p50_ms,
                                latency.p90_ms,
                                latency.p99_ms,
                                latency.max_ms,
                            )
                        ),
                    ]
                ],
            ),
            ("Waiting vs processing", plots["wait_vs_processing"], [], []),
            (
                "Deliveries per message",
                plots["receive_counts"],
                ["times received", "outcome", "messages"],
                [[count, outcome.replace("_", " "), f"{messages:,}"] for count, outcome, messages in receive_counts],
            ),
            (
                "Dead letters",
                plots["dead_letters"],
                ["reason", "messages"],
                [[reason, f"{messages:,}"] for reason, messages in dead_letters.items()],
            ),
            (
                "Load per shard",
                plots["shard_load"],
                ["shard", "sent", "received", "deleted", "dead-lettered", "bytes sent"],
                [[f"{value:,}" for value in row] for row in shard_rows],
            ),
        ],
        out_dir=out_dir,
    )
    summary.report_html.write_text(page, encoding="utf-8")
    summary.summary_json.write_text(json.dumps(summary.to_json_dict(), indent=2) + "\n", encoding="utf-8")
    journal.unpersist()
    lifecycles.unpersist()
    logger.info("report written to %s", summary.report_html)
    return summary
