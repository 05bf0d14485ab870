"""`import shardq` (and the Spark entry modules) work without loading pyspark:
the source and the report import it only when used."""

from __future__ import annotations

import subprocess
import sys


def test_entry_modules_import_without_loading_spark_or_plotting() -> None:
    probe = (
        "import sys, shardq, shardq.spark, shardq.analytics, shardq.analytics.report, shardq.analytics.job; "
        "print(sorted(m for m in ('pyspark', 'pyarrow', 'matplotlib', 'pandas') if m in sys.modules))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"
