"""Spark read throughput of the shardq data source, and how it scales with shards.

For each shard count (default 1, 2, 4) this starts a shard server on
127.0.0.1 with a fresh data directory, fills one queue with
`--messages-per-shard` messages per shard, and measures

- `messages`: a batch read of the stored messages (`read=messages`), and
- `journal`:  a batch read of the journal (`read=journal`, one SENT event per message),

each fully materialised through Spark's `noop` sink, best of `--repeats`
runs after one warm-up. For comparison, `export_only` is the same journal read
without Spark: one Python thread streaming the shards one after another and
converting to Arrow. Rows/s are reported in total and per shard.

    python bench/spark_read.py [--shards 1,2,4] [--messages-per-shard 100000] [--budget-seconds 600]

Prints one JSON document on stdout; progress goes to stderr. Stops starting
new measurements once the time budget is spent (they are reported as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

# Run as `python bench/spark_read.py`: the data-plane benchmark beside it starts and stops servers.
import dataplane

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
QUEUE = "bench"
SEND_BATCH = 500
BODY = b"b" * 100


def progress(text: str) -> None:
    print(f"[spark_read] {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def shard_server(shards: int) -> Iterator[str]:
    """A fresh `shardq serve` with one queue of `shards` shards, stopped by PID afterwards."""
    with tempfile.TemporaryDirectory(prefix="shardq-bench-spark-") as scratch:
        server = dataplane.start_server(pathlib.Path(scratch) / "data", f"{QUEUE}:shards={shards}", None)
        try:
            yield server.endpoint
        finally:
            dataplane.stop_process(server.process)


def fill(endpoint: str, messages: int) -> float:
    """Sends `messages` messages; returns the send rate (messages/s)."""
    from shardq import Client, Message

    started = time.perf_counter()
    with Client(endpoint) as client:
        sent = 0
        while sent < messages:
            count = min(SEND_BATCH, messages - sent)
            results = client.send_messages(QUEUE, [Message(body=BODY, attributes={"n": "1"})] * count)
            if not all(result.ok for result in results):
                raise RuntimeError(f"send failed: {next(r for r in results if not r.ok)}")
            sent += count
    return messages / (time.perf_counter() - started)


class Measurement:
    """`run` reads everything once and returns nothing; `count` returns how many rows a read gives."""

    def __init__(self, run: Callable[[], object], count: Callable[[], int]) -> None:
        self.run = run
        self.count = count


def best_seconds(measurement: Measurement, *, repeats: int, expected_rows: int) -> float:
    # Checked outside the timed runs, which only materialise: a short read must not pass.
    rows = measurement.count()
    if rows != expected_rows:
        raise RuntimeError(f"read {rows} rows, expected {expected_rows}")
    measurement.run()  # warm-up: Python workers, imports, page cache
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        measurement.run()
        timings.append(time.perf_counter() - started)
    return min(timings)


def spark_read(spark: Any, endpoint: str, read: str) -> Measurement:
    frame = spark.read.format("shardq").option("endpoint", endpoint).option("queue", QUEUE).option("read", read).load()

    def run() -> None:
        # The noop sink pulls every row of every column through Spark and stores nothing.
        frame.write.format("noop").mode("overwrite").save()

    def count() -> int:
        rows: int = frame.count()
        return rows

    return Measurement(run, count)


def export_only(endpoint: str, shards: int) -> Measurement:
    from shardq.spark.batches import journal_batch_from_proto
    from shardq.spark.exporting import ExportConnection

    def read_all() -> int:
        rows = 0
        with ExportConnection(endpoint, rpc_timeout_seconds=30.0) as connection:
            for shard in range(shards):
                for batch in connection.journal_batches(
                    queue=QUEUE, shard=shard, from_index=1, to_index=0, batch_size=1000
                ):
                    rows += journal_batch_from_proto(QUEUE, batch.events).num_rows
        return rows

    return Measurement(read_all, read_all)


def rate(rows: int, seconds: float, shards: int) -> dict[str, float]:
    return {
        "seconds": round(seconds, 3),
        "rows_per_second": round(rows / seconds),
        "rows_per_second_per_shard": round(rows / seconds / shards),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    parser.add_argument("--messages-per-shard", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-seconds", type=float, default=600.0)
    parser.add_argument("--master", default=None, help="Spark master (default local[max shards])")
    arguments = parser.parse_args()
    # A plain SIGTERM would skip the finally blocks that stop the shard servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    shard_counts = [int(text) for text in arguments.shards.split(",")]
    deadline = time.monotonic() + arguments.budget_seconds

    from pyspark.sql import SparkSession

    import shardq.spark

    # Spark's Python workers import shardq by name; make the checkout importable.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    master = arguments.master or f"local[{max(shard_counts)}]"
    spark = (
        SparkSession.builder.master(master)
        .appName("shardq-bench-spark-read")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(max(shard_counts)))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    shardq.spark.register(spark)

    results: list[dict[str, Any]] = []
    try:
        for shards in shard_counts:
            if time.monotonic() > deadline:
                results.append({"shards": shards, "skipped": "time budget spent"})
                continue
            rows = shards * arguments.messages_per_shard
            with shard_server(shards) as endpoint:
                progress(f"{shards} shard(s): sending {rows} messages")
                send_rate = fill(endpoint, rows)
                entry: dict[str, Any] = {"shards": shards, "rows": rows, "fill_messages_per_second": round(send_rate)}
                for name, measurement in (
                    ("messages", spark_read(spark, endpoint, "messages")),
                    ("journal", spark_read(spark, endpoint, "journal")),
                    ("export_only", export_only(endpoint, shards)),
                ):
                    if time.monotonic() > deadline:
                        entry[name] = {"skipped": "time budget spent"}
                        continue
                    progress(f"{shards} shard(s): measuring {name}")
                    seconds = best_seconds(measurement, repeats=arguments.repeats, expected_rows=rows)
                    entry[name] = rate(rows, seconds, shards)
                    progress(f"{shards} shard(s): {name} {entry[name]}")
                results.append(entry)
    finally:
        spark.stop()

    json.dump(
        {
            "benchmark": "spark_read",
            "spark_master": master,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "messages_per_shard": arguments.messages_per_shard,
            "body_bytes": len(BODY),
            "results": results,
        },
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
