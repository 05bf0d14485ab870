"""Command-line entry of the analytics report, for spark-submit and local runs.

    python -m shardq.analytics.job --endpoint 127.0.0.1:7400 --queue orders --out report/
    spark-submit --master k8s://... local:///opt/shardq/report_job.py --endpoint ... --queue orders --out /report/orders

The Spark master comes from spark-submit; run with plain python, the session
is local. Prints the summary as JSON on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import pathlib
import sys
from collections.abc import Sequence


def parse_since(text: str) -> datetime.datetime:
    """An ISO 8601 time (UTC when no zone is given) or a duration back from now (e.g. 1h, 30m)."""
    from shardq.durations import parse_duration_ms

    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        try:
            back_ms = parse_duration_ms(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--since takes an ISO time (2025-01-31T12:00) or a duration (1h, 30m), got {text!r}"
            ) from None
        return datetime.datetime.now(datetime.UTC) - datetime.timedelta(milliseconds=back_ms)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardq.analytics.job", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="host:port of any shardq server")
    parser.add_argument("--queue", required=True, help="queue to report on")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory for the report")
    parser.add_argument("--since", type=parse_since, default=None, help="ISO time or duration back from now")
    parser.add_argument("--master", default=None, help="Spark master when not run by spark-submit (e.g. local[2])")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, repeatable (e.g. spark.driver.bindAddress=127.0.0.1)",
    )
    return parser


def parse_conf(items: Sequence[str]) -> dict[str, str]:
    settings = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise SystemExit(f"shardq analytics: --conf {item!r} is not KEY=VALUE")
        settings[key.strip()] = value
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    settings = parse_conf(arguments.conf)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    from shardq.cli import explain
    from shardq.errors import ShardqError
    from shardq.spark.exporting import ExportConnection

    # Before Spark starts: a down server or an unknown queue is one line at once, not a JVM
    # trace. Only this check fails fast; the report's reads wait out restarts (retrySeconds).
    try:
        with ExportConnection(arguments.endpoint, rpc_timeout_seconds=10.0, retry_seconds=0) as connection:
            connection.shard_count(arguments.queue)
    except ShardqError as error:
        print(f"shardq analytics: {explain(error, arguments.endpoint)}", file=sys.stderr)
        return 1

    from pyspark.sql import SparkSession

    from shardq.analytics.report import run_report

    builder = SparkSession.builder.appName(f"shardq-report-{arguments.queue}")
    if arguments.master:
        builder = builder.master(arguments.master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        summary = run_report(
            endpoint=arguments.endpoint,
            queue=arguments.queue,
            out_dir=arguments.out,
            spark=spark,
            since=arguments.since,
        )
    finally:
        spark.stop()
    json.dump(summary.to_json_dict(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
