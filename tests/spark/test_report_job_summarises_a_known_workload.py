"""The bundled report job turns a scripted workload whose numbers are known
into those numbers, Parquet tables, PNG plots and an HTML page; its
command-line entry (what spark-submit runs) does the same."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from shardq import Client, Message, ReceivedMessage
from shardq.analytics.report import PARQUET_TABLES, PLOTS, run_report
from tests.support.servers import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

QUEUES = ["orders:shards=2,visibility=300ms,max_receive_count=2,dead_letter_queue=dlq", "dlq"]
DELETED = 20
DEAD_LETTERED = 4
PURGED = 5
PENDING = 6
PROCESSING_SECONDS = 0.25
POLL_DEADLINE_SECONDS = 30.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def send(client: Client, count: int, label: str) -> list[str]:
    ids = []
    for first in range(0, count, 5):
        messages = [Message(body=f"{label}-{i}".encode()) for i in range(first, min(first + 5, count))]
        results = client.send_messages("orders", messages)
        assert all(result.ok for result in results)
        ids += [result.message_id for result in results]
    return ids


def run_workload(endpoint: str) -> float:
    """20 messages processed in 250 ms each, 4 poison messages that are received
    twice and dead-lettered, 5 purged, 6 never touched. Returns the longest observed
    send-to-delete time in ms, an upper bound of every latency."""
    with Client(endpoint) as client:
        started = time.time()
        processed = set(send(client, DELETED, "processed"))
        received: list[ReceivedMessage] = []

        def all_received() -> bool:
            received.extend(client.receive_messages("orders", max_messages=10, visibility_timeout_ms=30_000))
            return len(received) >= DELETED

        wait_for(all_received, timeout=POLL_DEADLINE_SECONDS, what="the processed messages")
        assert {m.message_id for m in received} == processed
        time.sleep(PROCESSING_SECONDS)  # the scripted processing time
        assert all(r.ok for r in client.delete_messages("orders", [m.receipt for m in received]))
        longest_ms = (time.time() - started) * 1000

        poison = set(send(client, DEAD_LETTERED, "poison"))
        receives = dict.fromkeys(poison, 0)

        def all_dead_lettered() -> bool:
            # Each poll also dead-letters the messages past max_receive_count.
            for message in client.receive_messages("orders", max_messages=10, wait_time_ms=100):
                receives[message.message_id] += 1
            return client.attributes("dlq").visible >= DEAD_LETTERED

        wait_for(all_dead_lettered, timeout=POLL_DEADLINE_SECONDS, what="the poison messages in dlq")
        assert receives == dict.fromkeys(poison, 2)
        assert client.attributes("dlq").visible == DEAD_LETTERED

        # One batch (one shard, so one PURGED journal event), then a purge removes it.
        client.send_messages("orders", [Message(body=b"purged-%d" % i) for i in range(PURGED)])
        assert client.purge("orders") == PURGED

        send(client, PENDING, "pending")
    return longest_ms


def test_report_numbers_tables_and_plots_match_the_workload(spark, start_server, tmp_path: pathlib.Path) -> None:
    endpoint = start_server(QUEUES)
    longest_ms = run_workload(endpoint)

    summary = run_report(endpoint=endpoint, queue="orders", out_dir=tmp_path / "report", spark=spark)

    assert summary.shards == 2
    assert summary.messages_sent == DELETED + DEAD_LETTERED + PURGED + PENDING
    assert summary.messages_deleted == DELETED
    assert summary.messages_dead_lettered == DEAD_LETTERED
    assert summary.messages_purged == PURGED
    assert summary.messages_pending == PENDING
    assert summary.messages_expired == 0
    assert summary.messages_redelivered == DEAD_LETTERED
    assert summary.dead_letters_by_reason == {"max_receive_count": DEAD_LETTERED}
    # SENT, RECEIVED and DELETED of the processed; SENT, 2 x RECEIVED, DEAD_LETTERED
    # and DEAD_LETTER_DELIVERED of the poison; SENT of the purged and one PURGED;
    # SENT of the pending.
    assert summary.events == 3 * DELETED + 5 * DEAD_LETTERED + PURGED + 1 + PENDING
    assert summary.latency_messages == DELETED
    latencies = (summary.latency_p50_ms, summary.latency_p90_ms, summary.latency_p99_ms, summary.latency_max_ms)
    assert all(latency is not None for latency in latencies)
    assert min(latencies) >= PROCESSING_SECONDS * 1000
    assert max(latencies) <= longest_ms + 2
    assert sorted(latencies) == list(latencies)
    assert summary.sent_per_second is not None
    assert summary.sent_per_second > 0

    tables = {name: spark.read.parquet(str(summary.parquet[name])) for name in PARQUET_TABLES}
    assert tables["lifecycles"].count() == DELETED + DEAD_LETTERED + PURGED + PENDING
    outcomes = {row["outcome"]: row["count"] for row in tables["lifecycles"].groupBy("outcome").count().collect()}
    assert outcomes == {"deleted": DELETED, "dead_lettered": DEAD_LETTERED, "purged": PURGED, "pending": PENDING}
    receive_counts = {
        (row["receive_count"], row["outcome"]): row["messages"] for row in tables["receive_counts"].collect()
    }
    assert receive_counts == {
        (1, "deleted"): DELETED,
        (2, "dead_lettered"): DEAD_LETTERED,
        (0, "purged"): PURGED,
        (0, "pending"): PENDING,
    }
    load = tables["shard_load"].collect()
    assert sum(row["sent"] for row in load) == DELETED + DEAD_LETTERED + PURGED + PENDING
    assert sum(row["deleted"] for row in load) == DELETED
    throughput = {row["event_type"]: 0 for row in tables["throughput"].collect()}
    assert {"SENT", "RECEIVED", "DELETED", "DEAD_LETTERED"} <= set(throughput)
    assert tables["latency_percentiles"].count() > 100
    backlog = tables["backlog"].orderBy("bucket_end").collect()
    assert backlog[-1]["backlog"] == PENDING  # purges, deletes and dead letters all taken off
    assert max(row["backlog"] for row in backlog) <= DELETED + DEAD_LETTERED + PURGED + PENDING
    assert backlog[-1]["oldest_age_seconds"] is not None
    assert backlog[-1]["oldest_age_seconds"] >= 0

    page = summary.report_html.read_text()
    for name in PLOTS:
        plot = summary.plots[name]
        assert plot.read_bytes().startswith(PNG_MAGIC)
        assert plot.stat().st_size > 10_000
        assert f"src='plots/{plot.name}'" in page
    saved = json.loads(summary.summary_json.read_text())
    assert saved["messages_deleted"] == DELETED


def test_command_line_job_writes_the_report_and_prints_the_summary(start_server, tmp_path: pathlib.Path) -> None:
    endpoint = start_server(QUEUES)
    with Client(endpoint) as client:
        send(client, 12, "cli")
    out_dir = tmp_path / "cli-report"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardq.analytics.job",
            "--endpoint",
            endpoint,
            "--queue",
            "orders",
            "--out",
            str(out_dir),
            "--master",
            "local[1]",
            "--conf",
            "spark.ui.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    summary = json.loads(completed.stdout)
    assert summary["messages_sent"] == 12
    assert summary["messages_pending"] == 12
    assert summary["latency_p50_ms"] is None
    assert (out_dir / "report.html").is_file()
    assert all((out_dir / "plots" / f"{name}.png").is_file() for name in PLOTS)
    assert "reading the journal" in completed.stderr
