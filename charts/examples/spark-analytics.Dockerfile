# Image for the shardq analytics job on Spark-on-Kubernetes (SparkApplication or
# spark-submit --deploy-mode cluster). Build from the repository root:
#
#   docker build -f charts/examples/spark-analytics.Dockerfile -t shardq-analytics:0.1.0 .
#
# Why not FROM apache/spark: its 4.x images ship Ubuntu's Python 3.10, and
# shardq needs Python >= 3.11. This one is Debian bookworm's Python 3.11 with a
# Java 17 runtime; pyspark from PyPI brings Spark itself (jars, spark-submit,
# the Kubernetes resource manager), and entrypoint.sh starts drivers and
# executors the way Spark's own Kubernetes images do.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini procps \
 && rm -rf /var/lib/apt/lists/*

ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    PYSPARK_PYTHON=python3 \
    PYTHONUNBUFFERED=1

COPY pyproject.toml README.md /opt/shardq/src/
COPY shardq /opt/shardq/src/shardq
# shardq with the spark extra: pyspark (Spark >= 4.2: the Python Data Source
# streaming API with admission control), pyarrow, pandas and matplotlib.
RUN python3 -m pip install --no-cache-dir "/opt/shardq/src[spark]" \
 && ln -s "$(python3 -c 'import shardq.analytics.job as job; print(job.__file__)')" /opt/shardq/report_job.py \
 && ln -s "$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" /opt/spark

ENV SPARK_HOME=/opt/spark
COPY charts/examples/spark-image/entrypoint.sh /opt/entrypoint.sh
RUN chmod 0755 /opt/entrypoint.sh \
 && mkdir -p /opt/spark/work-dir \
 && useradd --uid 185 --gid 0 --home-dir /opt/spark/work-dir spark \
 && chown 185:0 /opt/spark/work-dir

WORKDIR /opt/spark/work-dir
# As in Spark's images: the unprivileged user 185.
USER 185
ENTRYPOINT ["/opt/entrypoint.sh"]
