"""The "shardq" Python data source: options in, readers and writers out."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, DataSourceWriter
from pyspark.sql.types import StructType

from shardq.spark import FORMAT_NAME
from shardq.spark.options import OptionError, ReadKind, read_options_from_spark, write_options_from_spark
from shardq.spark.reading import ShardqBatchReader, ShardqJournalStreamReader
from shardq.spark.schemas import JOURNAL_SCHEMA, MESSAGES_SCHEMA
from shardq.spark.writing import ShardqArrowWriter, validate_write_schema


class ShardqDataSource(DataSource):
    """Reads a queue's stored messages or its journal; writes rows as messages."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> StructType:
        read = read_options_from_spark(self.options).read
        return MESSAGES_SCHEMA if read is ReadKind.MESSAGES else JOURNAL_SCHEMA

    def _checked_read_schema(self, schema: StructType) -> None:
        if schema != self.schema():
            raise OptionError(
                "the shardq source has a fixed schema (see shardq.spark); select columns after "
                "loading instead of passing .schema(...)"
            )

    def reader(self, schema: StructType) -> DataSourceReader:
        self._checked_read_schema(schema)
        return ShardqBatchReader(read_options_from_spark(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        self._checked_read_schema(schema)
        options = read_options_from_spark(self.options)
        if options.read is not ReadKind.JOURNAL:
            raise OptionError(
                "streaming reads follow the journal: use option read=journal "
                "(a snapshot of stored messages is a batch read)"
            )
        return ShardqJournalStreamReader(options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise OptionError("a queue can only be appended to: use mode('append'), not 'overwrite'")
        validate_write_schema(schema)
        return ShardqArrowWriter(write_options_from_spark(self.options))
