"""Spark schemas of the two reads, and the Arrow schemas their batches must match.

The column meanings are documented in the `shardq.spark` package docstring.
"""

from __future__ import annotations

import functools

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

MESSAGES_SCHEMA = StructType(
    [
        StructField("queue", StringType(), nullable=False),
        StructField("shard", IntegerType(), nullable=False),
        StructField("seq", LongType(), nullable=False),
        StructField("message_id", StringType(), nullable=False),
        StructField("state", StringType(), nullable=False),
        StructField("sent_at", TimestampType()),
        StructField("first_received_at", TimestampType()),
        StructField("last_received_at", TimestampType()),
        StructField("visible_at", TimestampType()),
        StructField("receive_count", IntegerType(), nullable=False),
        StructField("size", IntegerType(), nullable=False),
        StructField("attributes", MapType(StringType(), StringType(), valueContainsNull=True)),
        StructField("group_id", StringType()),
        StructField("dedup_id", StringType()),
        StructField("body", BinaryType()),
        StructField("snapshot_log_index", LongType(), nullable=False),
    ]
)

JOURNAL_SCHEMA = StructType(
    [
        StructField("queue", StringType(), nullable=False),
        StructField("shard", IntegerType(), nullable=False),
        StructField("log_index", LongType(), nullable=False),
        StructField("epoch", LongType(), nullable=False),
        StructField("event_time", TimestampType(), nullable=False),
        StructField("event_type", StringType(), nullable=False),
        StructField("seq", LongType()),
        StructField("message_id", StringType()),
        StructField("sent_at", TimestampType()),
        StructField("size", IntegerType()),
        StructField("receive_count", IntegerType()),
        StructField("visible_at", TimestampType()),
        StructField("group_id", StringType()),
        StructField("reason", StringType()),
        StructField("source_queue", StringType()),
        StructField("purged_count", LongType()),
    ]
)


@functools.cache
def messages_arrow_schema() -> pa.Schema:
    # Spark compares each batch's schema with exactly this conversion.
    return to_arrow_schema(MESSAGES_SCHEMA, timezone="UTC")


@functools.cache
def journal_arrow_schema() -> pa.Schema:
    return to_arrow_schema(JOURNAL_SCHEMA, timezone="UTC")
