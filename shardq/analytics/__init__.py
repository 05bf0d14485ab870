"""The bundled Spark analytics job over a queue's journal.

`report.run_report(...)` computes throughput over time, end-to-end latency
(sent -> deleted) percentiles, the receive-count distribution, dead letters by
reason and per-shard load, and writes Parquet tables, PNG plots and an HTML
page. `python -m shardq.analytics.job` (or spark-submit of that module) runs
it from the command line. Importing this package does not import pyspark.
"""
