"""A streaming query over the journal with Trigger.AvailableNow reads new
entries batch after batch, at most maxRowsPerBatch at a time, and after a
restart continues from its checkpoint: every event exactly once."""

from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from shardq import Client, Message

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

MAX_ROWS_PER_BATCH = 4
EVENT_KEY = ("shard", "log_index", "event_type", "message_id")


def make_traffic(endpoint: str, *, sends: int, deletes: int) -> int:
    """One message or receipt per call, so each log index holds one event.
    Returns the number of journal events written."""
    with Client(endpoint) as client:
        for number in range(sends):
            [result] = client.send_messages("orders", [Message(body=f"m{number}".encode())])
            assert result.ok
        for _ in range(deletes):
            [received] = client.receive_messages("orders", max_messages=1, wait_time_ms=2000)
            [deleted] = client.delete_messages("orders", [received.receipt])
            assert deleted.ok
    return sends + 2 * deletes


def run_available_now(spark, endpoint: str, directory: pathlib.Path, **options: str) -> list[dict]:
    """Run the query until it has read what was there when it started; returns its progress."""
    reader = (
        spark.readStream.format("shardq")
        .option("endpoint", endpoint)
        .option("queue", "orders")
        .option("read", "journal")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(directory / "events"))
        .option("checkpointLocation", str(directory / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=240)
    assert not query.isActive, "the availableNow query did not finish"
    assert query.exception() is None, query.exception()
    return [json.loads(progress.json) for progress in query.recentProgress]


def offsets(value: str | dict[str, int] | None) -> dict[str, int]:
    """A source offset from query progress: JSON text, already-parsed JSON, or none yet."""
    if isinstance(value, str):
        return json.loads(value)
    return value or {}


def sink_rows(spark, directory: pathlib.Path) -> list[tuple]:
    return [tuple(row) for row in spark.read.parquet(str(directory / "events")).select(*EVENT_KEY).collect()]


def check_batches(progress: list[dict]) -> int:
    """Every batch within the limit and starting where the previous ended; returns rows read."""
    with_data = [p for p in progress if p["numInputRows"] > 0]
    for previous, current in itertools.pairwise(with_data):
        assert offsets(current["sources"][0]["startOffset"]) == offsets(previous["sources"][0]["endOffset"])
    for entry in with_data:
        assert entry["numInputRows"] <= MAX_ROWS_PER_BATCH, entry
    return sum(p["numInputRows"] for p in progress)


def test_available_now_reads_in_bounded_batches_and_resumes_after_restart(
    spark, start_server, read_queue, tmp_path: pathlib.Path
) -> None:
    endpoint = start_server(["orders:shards=2"])
    first_events = make_traffic(endpoint, sends=10, deletes=4)

    first = run_available_now(spark, endpoint, tmp_path, maxRowsPerBatch=str(MAX_ROWS_PER_BATCH))
    assert check_batches(first) == first_events
    assert len([p for p in first if p["numInputRows"] > 0]) >= first_events // MAX_ROWS_PER_BATCH
    # The source reports the latest offset: lag shows while batches remain...
    source_progress = [p["sources"][0] for p in first if p["numInputRows"] > 0]
    assert offsets(source_progress[0]["latestOffset"]) != offsets(source_progress[0]["endOffset"])
    # ...and is gone at the end.
    assert offsets(source_progress[-1]["latestOffset"]) == offsets(source_progress[-1]["endOffset"])
    assert len(sink_rows(spark, tmp_path)) == first_events

    second_events = make_traffic(endpoint, sends=6, deletes=2)
    second = run_available_now(spark, endpoint, tmp_path, maxRowsPerBatch=str(MAX_ROWS_PER_BATCH))
    # Only the new entries: the restart began at the first run's last offsets.
    assert check_batches(second) == second_events
    assert offsets(second[0]["sources"][0]["startOffset"]) == offsets(source_progress[-1]["endOffset"])

    third = run_available_now(spark, endpoint, tmp_path, maxRowsPerBatch=str(MAX_ROWS_PER_BATCH))
    assert check_batches(third) == 0

    stored = sink_rows(spark, tmp_path)
    assert len(stored) == len(set(stored)) == first_events + second_events
    journal = [tuple(row) for row in read_queue(endpoint, "orders", "journal").select(*EVENT_KEY).collect()]
    assert sorted(stored) == sorted(journal)


def test_latest_start_skips_history_and_no_limit_takes_everything_at_once(
    spark, start_server, tmp_path: pathlib.Path
) -> None:
    endpoint = start_server(["orders:shards=3"])
    make_traffic(endpoint, sends=5, deletes=1)

    skipped = run_available_now(spark, endpoint, tmp_path, startingOffsets="latest")
    assert sum(p["numInputRows"] for p in skipped) == 0

    new_events = make_traffic(endpoint, sends=9, deletes=3)
    taken = run_available_now(spark, endpoint, tmp_path, startingOffsets="latest")
    assert [p["numInputRows"] for p in taken if p["numInputRows"] > 0] == [new_events]
    assert all(row[3].startswith("01") for row in sink_rows(spark, tmp_path))
