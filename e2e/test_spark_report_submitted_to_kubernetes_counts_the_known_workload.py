"""The analytics report runs on Spark-on-Kubernetes as users submit it: spark-submit
in cluster mode against the real node's API server, a driver pod and two executor
pods of the Spark image, reading a ShardqCluster's shards by their in-cluster DNS
names, writing Parquet and the report to a volume; the report counts the known
workload exactly. And the example SparkApplication says what the command submits."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow.parquet
import pyspark
import pytest
import yaml

from e2e import spark_on_kubernetes
from e2e.realnode import RunningNode
from e2e.spark_image import APPLICATION, REPOSITORY
from e2e.spark_on_kubernetes import (
    PENDING,
    POISON,
    PROCESSED,
    QUEUE,
    SHARDS,
    Expected,
    Submission,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "spark" / "report-sparkapplication.yaml"


@pytest.mark.realnode
@pytest.mark.timeout(1200)
def test_spark_submit_on_the_node_reports_exactly_the_known_workload(real_node: RunningNode, tmp_path: Path) -> None:
    real_node.own_node("spark-submit against this machine's API server, a hostPath report volume")
    namespace = f"spark-{uuid.uuid4().hex[:10]}"
    record = spark_on_kubernetes.run(namespace=namespace, report_parent=tmp_path, work_dir=tmp_path)

    report = Path(record["report_dir"]) / QUEUE
    # The cluster refused a call without a token, and the Spark pods' account anything
    # but export: the report below was read with the credentials the pod template gave.
    assert record["refused"] == {"without_a_token": "UNAUTHENTICATED", "spark_account_receiving": "PERMISSION_DENIED"}
    summary = record["report_summary"]
    assert summary["shards"] == SHARDS
    assert summary["messages_sent"] == PROCESSED + POISON + PENDING
    assert summary["messages_deleted"] == PROCESSED
    assert summary["messages_dead_lettered"] == POISON
    assert summary["messages_pending"] == PENDING
    assert summary["messages_redelivered"] == POISON
    assert summary["events"] == Expected().events
    # Parquet the executors wrote, read back on the host.
    lifecycles = pyarrow.parquet.read_table(report / "parquet" / "lifecycles").to_pylist()
    assert len(lifecycles) == PROCESSED + POISON + PENDING
    outcomes = dict.fromkeys(("deleted", "dead_lettered", "pending"), 0)
    for row in lifecycles:
        outcomes[row["outcome"]] += 1
    assert outcomes == {"deleted": PROCESSED, "dead_lettered": POISON, "pending": PENDING}
    assert (report / "report.html").is_file()
    # The pods really ran on the node and their cgroups were read while they did.
    memory = record["memory"]
    assert len(memory["driver"]) == 1
    assert len(memory["executors"]) == int(record["spark_conf"]["spark.executor.instances"])
    for pod in memory["driver"] + memory["executors"]:
        assert 0 < pod["peak_rss_mib"] <= pod["peak_mib"] <= pod["limit_mib"], pod


def example() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return loaded


def test_the_example_spark_application_submits_what_the_command_submits() -> None:
    application = example()
    assert application["apiVersion"] == "sparkoperator.k8s.io/v1beta2"
    assert application["kind"] == "SparkApplication"
    spec, metadata = application["spec"], application["metadata"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    volume = volumes[spark_on_kubernetes.REPORT_VOLUME]
    submission = Submission(
        namespace=spark_on_kubernetes.DEFAULT_NAMESPACE,
        image=spec["image"],
        endpoint=spark_on_kubernetes.in_cluster_endpoint(spark_on_kubernetes.DEFAULT_NAMESPACE),
        report_host_path=Path(volume["hostPath"]["path"]),
    )
    assert spec["type"] == "Python"
    assert spec["mode"] == "cluster"
    assert spec["mainApplicationFile"] == APPLICATION
    assert spec["arguments"] == submission.job_arguments()
    assert spec["image"].rsplit(":", 1)[0] == REPOSITORY
    assert spec["sparkVersion"] == pyspark.__version__
    # Every setting the command passes, as the SparkApplication expresses it: a field of
    # its own where the CRD has one, else in sparkConf. A setting added to the command
    # fails here until the example says it too.
    driver, executor = spec["driver"], spec["executor"]
    mount = f"spark.kubernetes.{{}}.volumes.hostPath.{spark_on_kubernetes.REPORT_VOLUME}"
    as_fields = {
        "spark.kubernetes.namespace": metadata["namespace"],
        **{f"spark.kubernetes.driverEnv.{e['name']}": e["value"] for e in spec["driver"]["env"]},
        **{f"spark.executorEnv.{e['name']}": e["value"] for e in spec["executor"]["env"]},
        "spark.kubernetes.container.image": spec["image"],
        "spark.kubernetes.container.image.pullPolicy": spec["imagePullPolicy"],
        "spark.kubernetes.authenticate.driver.serviceAccountName": driver["serviceAccount"],
        # The operator names the driver pod <application>-driver.
        "spark.kubernetes.driver.pod.name": f"{metadata['name']}-driver",
        "spark.executor.instances": str(executor["instances"]),
        "spark.driver.cores": str(driver["cores"]),
        "spark.executor.cores": str(executor["cores"]),
        "spark.kubernetes.driver.request.cores": driver["coreRequest"],
        "spark.kubernetes.executor.request.cores": executor["coreRequest"],
        "spark.driver.memory": driver["memory"],
        "spark.driver.memoryOverhead": driver["memoryOverhead"],
        "spark.executor.memory": executor["memory"],
        **{
            f"{mount.format(role)}.mount.path": next(
                m["mountPath"] for m in spec[role]["volumeMounts"] if m["name"] == volume["name"]
            )
            for role in ("driver", "executor")
        },
        **{f"{mount.format(role)}.options.path": volume["hostPath"]["path"] for role in ("driver", "executor")},
    }
    # spark-submit's own progress lines: nothing for the operator to run.
    submission_only = {"spark.kubernetes.report.interval"}
    expressed = {**as_fields, **spec["sparkConf"]}
    wanted = {key: value for key, value in submission.spark_conf().items() if key not in submission_only}
    assert expressed == wanted
    # What the command's pod template adds to every pod, the SparkApplication says with
    # its own volumes and mounts: the same credentials volume, mounted alike in both roles.
    template = submission.pod_template()["spec"]
    assert set(volumes) == {spark_on_kubernetes.REPORT_VOLUME} | {v["name"] for v in template["volumes"]}
    assert [volumes[v["name"]] for v in template["volumes"]] == template["volumes"]
    (container,) = template["containers"]
    for role in ("driver", "executor"):
        mounts = [m for m in spec[role]["volumeMounts"] if m["name"] != spark_on_kubernetes.REPORT_VOLUME]
        assert mounts == container["volumeMounts"], role
