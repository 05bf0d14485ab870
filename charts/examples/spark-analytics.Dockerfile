# Image for the shardq analytics job on Spark-on-Kubernetes (SparkApplication or
# spark-submit --deploy-mode cluster). Build from the repository root:
#
#   docker build -f charts/examples/spark-analytics.Dockerfile -t shardq-analytics:0.1.0 .
#
# The base must be an Apache Spark >= 4.2 image with Python >= 3.11 (the Python
# Data Source streaming API with admission control is 4.2+; shardq needs 3.11):
# it brings the Spark-on-Kubernetes entrypoint and pyspark, which spark-submit
# puts on the Python path of driver and executors.
ARG SPARK_IMAGE=apache/spark:4.3.0-java17-python3
FROM ${SPARK_IMAGE}

USER root
COPY pyproject.toml README.md /opt/shardq/src/
COPY shardq /opt/shardq/src/shardq
# shardq plus what the data source and the report need, but not a second Spark.
# pandas < 3: pyspark 4.3 warns that it does not support pandas 3 yet.
RUN python3 -m pip install --no-cache-dir /opt/shardq/src "pyarrow>=17" "pandas>=2.2,<3" "matplotlib>=3.9" \
 && ln -s "$(python3 -c 'import shardq.analytics.job as job; print(job.__file__)')" /opt/shardq/report_job.py

# The Spark images run as the unprivileged user 185.
USER 185
