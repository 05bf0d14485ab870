"""`df.write.format("shardq")` gives every row a deterministic dedup id, so a
task that fails half-way and is retried, or a whole write run again with the
same writeId, stores each row once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from shardq import Client
from tests.support.servers import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

ROWS = 600
PARTITIONS = 2
# The failing write runs as one task whose first attempt fails three quarters through.
FAIL_AT_ID = 450
# Spark streams rows to the writer through 64 KiB buffers: rows this big reach
# it (and the queue) long before the failing row is produced.
BODY_PADDING = "x" * 2048
GATE_SECONDS = 30.0
SEND_BATCH = "20"


@pytest.fixture
def small_arrow_batches(spark: SparkSession) -> Iterator[None]:
    # The writer gets rows in Arrow batches; small ones make it send while the
    # failing attempt is still running, as it would with a big partition.
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(key)
    spark.conf.set(key, "50")
    yield
    spark.conf.set(key, previous)


def fail_first_attempt_once_rows_are_stored(endpoint: str, queue: str) -> Callable[[int], str]:
    """A UDF producing `order-<id>` bodies whose first attempt fails at FAIL_AT_ID,
    but only after the queue holds rows this task sent: the failure must
    strike a task that has written part of its partition."""

    def body(row_id: int) -> str:
        context = TaskContext.get()
        if context is not None and context.attemptNumber() == 0 and row_id == FAIL_AT_ID:
            deadline = time.monotonic() + GATE_SECONDS
            with Client(endpoint) as client:
                while client.attributes(queue).visible == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)  # the writer sends the rows before this one meanwhile
            raise RuntimeError("simulated task failure")
        return f"order-{row_id} {BODY_PADDING}"

    return body


def attempt_specific_id(row_id: int) -> str:
    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else -1
    return f"attempt-{attempt}-row-{row_id}"


def rows_failing_once(spark: SparkSession, endpoint: str, queue: str) -> DataFrame:
    body = sf.udf(fail_first_attempt_once_rows_are_stored(endpoint, queue), "string", useArrow=False)
    return spark.range(ROWS, numPartitions=1).select(
        body("id").alias("body"),
        sf.create_map(sf.lit("row"), sf.col("id").cast("string")).alias("attributes"),
    )


def write(frame: DataFrame, endpoint: str, queue: str, **options: str) -> None:
    writer = frame.write.format("shardq").mode("append").option("endpoint", endpoint).option("queue", queue)
    writer = writer.option("batchSize", SEND_BATCH)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.save()


def stored_bodies(read_queue, endpoint: str, queue: str) -> Counter[str]:
    rows = read_queue(endpoint, queue, "messages", includeBody="true").select("body").collect()
    # Bodies are "order-<id>" plus optional padding.
    return Counter(bytes(row["body"]).decode().split(" ")[0] for row in rows)


def test_retried_task_stores_each_row_once(spark, start_server, read_queue, small_arrow_batches) -> None:
    endpoint = start_server(["orders:shards=4,dedup_window=10m", "control:shards=4,dedup_window=10m"])

    # Control: ids that differ per attempt show that the failed attempt really
    # sent rows before it died; its retry then stores them a second time.
    with_attempt_ids = rows_failing_once(spark, endpoint, "control").withColumn(
        "dedup_id", sf.udf(attempt_specific_id, "string", useArrow=False)(sf.col("attributes")["row"].cast("long"))
    )
    write(with_attempt_ids, endpoint, "control")
    control = stored_bodies(read_queue, endpoint, "control")
    assert set(control) == {f"order-{i}" for i in range(ROWS)}
    assert sum(control.values()) > ROWS, "the failed attempt sent nothing: the retry case is not exercised"

    # The same failure with generated ids: the retry's repeats are deduplicated.
    write(rows_failing_once(spark, endpoint, "orders"), endpoint, "orders")
    stored = stored_bodies(read_queue, endpoint, "orders")
    assert stored == Counter({f"order-{i}": 1 for i in range(ROWS)})


def test_rerun_with_same_write_id_sends_nothing_new(spark, start_server, read_queue) -> None:
    endpoint = start_server(["orders:shards=3,dedup_window=10m"])
    frame = spark.range(ROWS, numPartitions=PARTITIONS).select(
        sf.concat(sf.lit("order-"), sf.col("id").cast("string")).cast("binary").alias("body")
    )
    write(frame, endpoint, "orders", writeId="nightly-2025-01-31")
    write(frame, endpoint, "orders", writeId="nightly-2025-01-31")
    assert stored_bodies(read_queue, endpoint, "orders") == Counter({f"order-{i}": 1 for i in range(ROWS)})
    sent_events = read_queue(endpoint, "orders", "journal").where("event_type = 'SENT'").count()
    assert sent_events == ROWS

    # A different writeId is a different write: its rows are new messages.
    write(frame.limit(10), endpoint, "orders", writeId="nightly-2025-02-01")
    assert sum(stored_bodies(read_queue, endpoint, "orders").values()) == ROWS + 10


def test_rows_bring_their_own_dedup_ids_group_ids_and_attributes(spark, start_server, read_queue) -> None:
    endpoint = start_server(["orders:shards=2,fifo=true,dedup_window=10m"])
    frame = spark.createDataFrame(
        [
            ("first", {"k": "1"}, "group-a", "order-1"),
            ("second", {"k": "2"}, "group-a", "order-2"),
            ("second again", {"k": "2"}, "group-a", "order-2"),
            ("third", None, "group-b", "order-3"),
        ],
        "body string, attributes map<string,string>, group_id string, dedup_id string",
    )
    # One partition: rows are sent in order, so the first "order-2" is the one kept.
    write(frame.coalesce(1), endpoint, "orders")
    rows = read_queue(endpoint, "orders", "messages", includeBody="true").collect()
    stored = {row["dedup_id"]: (bytes(row["body"]), row["group_id"], row["attributes"]) for row in rows}
    assert stored == {
        "order-1": (b"first", "group-a", {"k": "1"}),
        "order-2": (b"second", "group-a", {"k": "2"}),
        "order-3": (b"third", "group-b", {}),
    }
    with Client(endpoint) as client:
        received = client.receive_messages("orders", max_messages=10)
    # FIFO: one message per group in flight, the group's first first.
    assert sorted(m.body for m in received) == [b"first", b"third"]


def test_rows_bring_their_priority_lanes(spark, start_server) -> None:
    endpoint = start_server(["jobs:priority_lanes=3"])
    frame = spark.createDataFrame(
        [("routine", None), ("urgent", 2), ("soon", 1), ("later", 0)], "body string, priority int"
    )
    write(frame.coalesce(1), endpoint, "jobs")
    with Client(endpoint) as client:
        received = client.receive_messages("jobs", max_messages=10)
    assert [(m.body, m.priority) for m in received] == [
        (b"urgent", 2),
        (b"soon", 1),
        (b"routine", 0),
        (b"later", 0),
    ]


def test_unknown_columns_and_overwrite_are_refused(spark, start_server) -> None:
    endpoint = start_server(["orders"])
    typo = spark.createDataFrame([("x", "y")], "body string, atributes string")
    with pytest.raises(Exception, match="atributes"):
        write(typo, endpoint, "orders")
    frame = spark.createDataFrame([("x",)], "body string")
    with pytest.raises(Exception, match="append"):
        frame.write.format("shardq").mode("overwrite").option("endpoint", endpoint).option("queue", "orders").save()


def test_write_into_a_full_queue_waits_for_room_and_stores_each_row_once(spark, start_server, read_queue) -> None:
    endpoint = start_server(["orders:shards=2,max_depth=40,dedup_window=10m"])
    rows = 160
    consumed: list[bytes] = []
    stop = threading.Event()

    def consume() -> None:
        # Makes room slowly: the writer runs into the depth limit again and again.
        with Client(endpoint) as client:
            while not stop.is_set():
                received = client.receive_messages("orders", max_messages=5, wait_time_ms=100)
                if received:
                    assert all(r.ok for r in client.delete_messages("orders", [m.receipt for m in received]))
                    consumed.extend(m.body for m in received)

    consumer = threading.Thread(target=consume, name="consumer")
    consumer.start()
    try:
        frame = spark.range(rows, numPartitions=2).select(
            sf.concat(sf.lit("order-"), sf.col("id").cast("string")).alias("body")
        )
        write(frame, endpoint, "orders", queueFullPatienceSeconds="120")
        with Client(endpoint) as client:
            wait_for(lambda: client.attributes("orders").visible == 0, timeout=60, what="the consumer to catch up")
    finally:
        stop.set()
        consumer.join(timeout=30)
    assert Counter(body.decode() for body in consumed) == Counter({f"order-{i}": 1 for i in range(rows)})
    assert stored_bodies(read_queue, endpoint, "orders") == Counter()
