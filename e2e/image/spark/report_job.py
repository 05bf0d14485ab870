"""The analytics report as spark-submit runs it in the image: local:///opt/shardq/report_job.py."""

import sys

from shardq.analytics.job import main

sys.exit(main())
