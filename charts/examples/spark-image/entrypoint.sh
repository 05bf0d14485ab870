#!/usr/bin/env bash
# Starts a Spark-on-Kubernetes driver or executor, as the entrypoint of Spark's
# own images does (kubernetes/dockerfiles/spark/entrypoint.sh in the Spark
# sources), for an image whose Spark comes from the pyspark package.
set -euo pipefail

SPARK_CLASSPATH="${SPARK_CLASSPATH:-}:${SPARK_HOME}/jars/*"
# Executor JVM options arrive as SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ...
mapfile -t SPARK_EXECUTOR_JAVA_OPTS < <(env | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n | sed 's/[^=]*=\(.*\)/\1/')

case "${1:-}" in
  driver)
    shift
    exec /usr/bin/tini -s -- "${SPARK_HOME}/bin/spark-submit" \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
      --conf "spark.executorEnv.SPARK_DRIVER_POD_IP=${SPARK_DRIVER_BIND_ADDRESS}" \
      --deploy-mode client \
      "$@"
    ;;
  executor)
    shift
    exec /usr/bin/tini -s -- "${JAVA_HOME}/bin/java" \
      "${SPARK_EXECUTOR_JAVA_OPTS[@]}" \
      -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
      -cp "${SPARK_CLASSPATH}" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "${SPARK_DRIVER_URL}" \
      --executor-id "${SPARK_EXECUTOR_ID}" \
      --cores "${SPARK_EXECUTOR_CORES}" \
      --app-id "${SPARK_APPLICATION_ID}" \
      --hostname "${SPARK_EXECUTOR_POD_IP}" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" \
      --podName "${SPARK_EXECUTOR_POD_NAME}"
    ;;
  *)
    exec /usr/bin/tini -s -- "$@"
    ;;
esac
