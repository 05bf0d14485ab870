#!/usr/bin/env bash
# The bundled shardq report with plain spark-submit against a Kubernetes API
# server (no spark-operator). Needs the objects in spark-analytics-rbac.yaml and
# the image from spark-analytics.Dockerfile; spark-submit itself comes with
# `pip install pyspark` (>= 4.2) and Java 17 on the submitting machine. The pod
# template spark-pod-template.yaml gives the driver and the executors a token and
# the cluster's CA; for a cluster without TLS and client authentication, drop it
# and the four SHARDQ_* settings.
#
#   K8S_API=https://kubernetes.example:6443 charts/examples/spark-submit-report.sh orders
set -euo pipefail

queue="${1:?usage: spark-submit-report.sh QUEUE [ENDPOINT]}"
# The client Service of the ShardqCluster the queue lives on (<cluster>-shardq): the
# chart's cluster `default`, installed in namespace `shardq-system` (Services are per
# cluster, not per queue).
endpoint="${2:-default-shardq.shardq-system.svc.cluster.local:7600}"
api="${K8S_API:?set K8S_API to the Kubernetes API server URL}"
namespace="${NAMESPACE:-shardq-analytics}"
image="${IMAGE:-shardq-analytics:0.1.0}"
template="$(dirname "$0")/spark-pod-template.yaml"

exec spark-submit \
  --master "k8s://${api}" \
  --deploy-mode cluster \
  --name "shardq-report-${queue}" \
  --conf spark.kubernetes.namespace="${namespace}" \
  --conf spark.kubernetes.authenticate.driver.serviceAccountName=shardq-spark \
  --conf spark.kubernetes.container.image="${image}" \
  --conf spark.executor.instances=2 \
  --conf spark.executor.memory=1g \
  --conf spark.driver.memory=1g \
  --conf spark.sql.session.timeZone=UTC \
  --conf "spark.kubernetes.driver.volumes.persistentVolumeClaim.report.options.claimName=shardq-report" \
  --conf "spark.kubernetes.driver.volumes.persistentVolumeClaim.report.mount.path=/report" \
  --conf "spark.kubernetes.executor.volumes.persistentVolumeClaim.report.options.claimName=shardq-report" \
  --conf "spark.kubernetes.executor.volumes.persistentVolumeClaim.report.mount.path=/report" \
  --conf spark.kubernetes.driver.podTemplateFile="${template}" \
  --conf spark.kubernetes.executor.podTemplateFile="${template}" \
  --conf spark.kubernetes.driverEnv.SHARDQ_TOKEN_FILE=/var/run/secrets/shardq/token \
  --conf spark.kubernetes.driverEnv.SHARDQ_CA_FILE=/var/run/secrets/shardq/ca.crt \
  --conf spark.executorEnv.SHARDQ_TOKEN_FILE=/var/run/secrets/shardq/token \
  --conf spark.executorEnv.SHARDQ_CA_FILE=/var/run/secrets/shardq/ca.crt \
  local:///opt/shardq/report_job.py \
  --endpoint "${endpoint}" --queue "${queue}" --out "/report/${queue}" --since 24h
