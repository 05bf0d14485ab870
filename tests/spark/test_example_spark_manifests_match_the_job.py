"""The example SparkApplication, RBAC, spark-submit script and Dockerfile in
charts/examples agree with each other and with the job's command line."""

from __future__ import annotations

import pathlib
import re
import shlex

import yaml

from shardq.analytics.job import build_parser

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "charts" / "examples"


def load(name: str) -> list[dict]:
    return list(yaml.safe_load_all((EXAMPLES / name).read_text()))


def test_spark_application_runs_the_job_file_the_image_provides_with_valid_arguments() -> None:
    [application] = load("spark-analytics-sparkapplication.yaml")
    assert application["apiVersion"] == "sparkoperator.k8s.io/v1beta2"
    assert application["kind"] == "SparkApplication"
    spec = application["spec"]
    assert spec["type"] == "Python"
    dockerfile = (EXAMPLES / "spark-analytics.Dockerfile").read_text()
    job_path = spec["mainApplicationFile"].removeprefix("local://")
    assert job_path in dockerfile
    arguments = build_parser().parse_args(spec["arguments"])
    assert arguments.queue
    assert arguments.endpoint
    assert arguments.out
    major, minor, _ = (int(part) for part in spec["sparkVersion"].split("."))
    assert (major, minor) >= (4, 2)


def test_driver_runs_as_the_service_account_the_rbac_binds() -> None:
    [application] = load("spark-analytics-sparkapplication.yaml")
    objects = {document["kind"]: document for document in load("spark-analytics-rbac.yaml")}
    namespace = application["metadata"]["namespace"]
    account = application["spec"]["driver"]["serviceAccount"]
    assert objects["Namespace"]["metadata"]["name"] == namespace
    assert objects["ServiceAccount"]["metadata"]["name"] == account
    assert objects["ServiceAccount"]["metadata"]["namespace"] == namespace
    binding = objects["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    assert binding["roleRef"]["name"] == objects["Role"]["metadata"]["name"]
    pod_rules = [rule for rule in objects["Role"]["rules"] if "pods" in rule["resources"]]
    assert {"create", "delete", "watch"} <= set(pod_rules[0]["verbs"])
    claim = application["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert objects["PersistentVolumeClaim"]["metadata"]["name"] == claim


def test_spark_submit_script_uses_the_same_account_image_and_job() -> None:
    script = (EXAMPLES / "spark-submit-report.sh").read_text()
    [application] = load("spark-analytics-sparkapplication.yaml")
    assert f"serviceAccountName={application['spec']['driver']['serviceAccount']}" in script
    assert application["spec"]["image"] in script
    assert application["spec"]["mainApplicationFile"] in script
    job_arguments = re.search(r"report_job\.py \\\n\s*(.+)$", script, re.MULTILINE)
    assert job_arguments is not None
    words = [w.replace("${queue}", "orders").replace("${endpoint}", "e:1") for w in shlex.split(job_arguments[1])]
    assert build_parser().parse_args(words).queue == "orders"


def test_the_image_has_the_python_shardq_needs_and_the_entrypoint_it_names() -> None:
    dockerfile = (EXAMPLES / "spark-analytics.Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    match = re.fullmatch(r"python:3\.(\d+)-slim-bookworm", base)
    assert match, f"the base must pin a Python >= 3.11 image, got {base}"
    assert int(match[1]) >= 11
    assert "openjdk-17-jre-headless" in dockerfile
    (entrypoint,) = re.findall(r"^COPY (\S+) /opt/entrypoint.sh", dockerfile, re.MULTILINE)
    script = (EXAMPLES.parents[1] / entrypoint).read_text()
    assert "KubernetesExecutorBackend" in script
    assert "--deploy-mode client" in script


def test_the_job_docstring_the_spark_application_and_the_script_name_the_same_job_and_endpoint() -> None:
    import shardq.analytics.job as job

    [application] = load("spark-analytics-sparkapplication.yaml")
    assert job.__doc__ is not None
    assert application["spec"]["mainApplicationFile"] in job.__doc__
    endpoint = application["spec"]["arguments"][application["spec"]["arguments"].index("--endpoint") + 1]
    script = (EXAMPLES / "spark-submit-report.sh").read_text()
    assert f'endpoint="${{2:-{endpoint}}}"' in script
    # A ShardqCluster's client Service (<cluster>.<namespace>.svc), not one per queue.
    host = endpoint.split(":")[0]
    assert host.endswith(".svc.cluster.local")
    assert not host.startswith("orders.")
