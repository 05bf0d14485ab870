"""The package docstring documents every column of both reads and every write column."""

from __future__ import annotations

import shardq.spark
from shardq.spark.schemas import JOURNAL_SCHEMA, MESSAGES_SCHEMA
from shardq.spark.writing import WRITE_COLUMNS


def test_every_read_column_is_documented_with_its_type() -> None:
    doc = shardq.spark.__doc__ or ""
    for schema in (MESSAGES_SCHEMA, JOURNAL_SCHEMA):
        for field in schema.fields:
            documented = [line for line in doc.splitlines() if line.startswith(field.name + " ")]
            assert documented, f"{field.name} is not documented"
            spark_type = field.dataType.simpleString()
            assert any(spark_type in line for line in documented), (field.name, spark_type, documented)


def test_every_write_column_is_documented() -> None:
    doc = shardq.spark.__doc__ or ""
    for column in WRITE_COLUMNS:
        assert f"``{column}``" in doc
