#!/bin/bash
# Entrypoint of the shardq Spark image: Spark's Kubernetes backend starts the
# driver pod with `driver ARGS...` and executor pods with `executor` plus
# environment variables; anything else runs as given. It does what Spark's own
# image entrypoint does (resource-managers/kubernetes/docker/.../entrypoint.sh
# in the Spark sources), for a Spark that comes from the pyspark wheel.
set -euo pipefail

# Hadoop's user lookup fails for a uid with no passwd entry (an OpenShift-style
# random uid): give it one when we can.
if ! getent passwd "$(id -u)" >/dev/null && [ -w /etc/passwd ]; then
  echo "$(id -u):x:$(id -u):$(id -g):${SPARK_USER_NAME:-anonymous uid}:${SPARK_HOME}:/bin/false" >>/etc/passwd
fi

# The configuration Spark mounts (spark.properties, log4j2.properties) comes
# before the jars, as in Spark's image.
classpath="${SPARK_CONF_DIR:-${SPARK_HOME}/conf}:${SPARK_HOME}/jars/*"
if [ -n "${SPARK_EXTRA_CLASSPATH:-}" ]; then
  classpath="${classpath}:${SPARK_EXTRA_CLASSPATH}"
fi

case "${1:-}" in
  driver)
    shift
    # Inside its pod the driver is a client-mode application; cluster mode here
    # would submit yet another driver pod.
    exec /usr/bin/tini -s -- "${SPARK_HOME}/bin/spark-submit" \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
      --deploy-mode client \
      "$@"
    ;;
  executor)
    shift
    # The driver passes executor JVM options as SPARK_JAVA_OPT_0, _1, ... in order.
    java_options=()
    while IFS= read -r option; do
      java_options+=("${option}")
    done < <(env | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n | sed 's/^[^=]*=//')
    exec /usr/bin/tini -s -- "${JAVA_HOME}/bin/java" \
      "${java_options[@]}" \
      "-Xms${SPARK_EXECUTOR_MEMORY}" "-Xmx${SPARK_EXECUTOR_MEMORY}" \
      -cp "${classpath}" \
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
