"""The example SparkApplication, RBAC, spark-submit script and Dockerfile in
charts/examples agree with each other and with the job's command line."""

from __future__ import annotations

import pathlib
import re
import shlex

import yaml
from shardq_operator import naming

from e2e.cluster_tls import credentials_environment, credentials_volume
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
    namespace = application["metadata"]["namespace"]
    # The objects of the job's namespace (the export Role lives in the cluster's).
    objects = {
        document["kind"]: document
        for document in load("spark-analytics-rbac.yaml")
        if document["metadata"].get("namespace", namespace) == namespace
    }
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


def test_the_account_may_export_the_queue_it_reports_on_where_the_cluster_checks_it() -> None:
    [application] = load("spark-analytics-sparkapplication.yaml")
    arguments = build_parser().parse_args(application["spec"]["arguments"])
    namespace = application["metadata"]["namespace"]
    account = application["spec"]["driver"]["serviceAccount"]
    # The servers ask about the queue in their own namespace: the endpoint's.
    cluster_namespace = arguments.endpoint.split(":")[0].split(".")[1]
    documents = load("spark-analytics-rbac.yaml")
    roles = [d for d in documents if d["kind"] == "Role" and d["metadata"]["namespace"] == cluster_namespace]
    (role,) = roles
    assert role["rules"] == [
        {"apiGroups": ["shardq.io"], "resources": ["queues"], "resourceNames": [arguments.queue], "verbs": ["export"]}
    ]
    (binding,) = [
        d for d in documents if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == cluster_namespace
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]


def test_the_application_and_the_script_show_the_same_credentials() -> None:
    """The SparkApplication's credentials volume and mounts are the script's pod template,
    and its env is what the script sets; the variables name files in the mounted volume."""
    [application] = load("spark-analytics-sparkapplication.yaml")
    [template] = load("spark-pod-template.yaml")
    spec = application["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    for volume in template["spec"]["volumes"]:
        assert volumes[volume["name"]] == volume
    (container,) = template["spec"]["containers"]
    script = (EXAMPLES / "spark-submit-report.sh").read_text()
    assert 'template="$(dirname "$0")/spark-pod-template.yaml"' in script
    for role in ("driver", "executor"):
        assert f'spark.kubernetes.{role}.podTemplateFile="${{template}}"' in script
        mounts = [
            m for m in spec[role]["volumeMounts"] if m["name"] in {v["name"] for v in template["spec"]["volumes"]}
        ]
        assert mounts == container["volumeMounts"], role
        prefix = "spark.kubernetes.driverEnv" if role == "driver" else "spark.executorEnv"
        env = {e["name"]: e["value"] for e in spec[role]["env"]}
        for name, value in env.items():
            assert f"--conf {prefix}.{name}={value} " in script
    # The same volume and variables as the Spark run on the real node shows its pods
    # (e2e/spark_on_kubernetes.py), for the audience the chart's servers expect.
    chart_values = yaml.safe_load((EXAMPLES.parent / "shardq" / "values.yaml").read_text())
    audience = chart_values["cluster"]["clientAuthentication"]["audience"]
    (volume,) = template["spec"]["volumes"]
    assert volume == credentials_volume(volume["name"], audience=audience, ca_config_map="shardq-ca")
    assert {e["name"]: e["value"] for e in spec["driver"]["env"]} == credentials_environment()


def test_the_job_docstring_the_spark_application_and_the_script_name_the_same_job_and_endpoint() -> None:
    import shardq.analytics.job as job

    [application] = load("spark-analytics-sparkapplication.yaml")
    assert job.__doc__ is not None
    assert application["spec"]["mainApplicationFile"] in job.__doc__
    endpoint = application["spec"]["arguments"][application["spec"]["arguments"].index("--endpoint") + 1]
    script = (EXAMPLES / "spark-submit-report.sh").read_text()
    assert f'endpoint="${{2:-{endpoint}}}"' in script
    # The chart's cluster's client Service (<cluster>-shardq.<namespace>.svc), as the
    # operator names it: one per cluster, not per queue.
    host = endpoint.split(":")[0]
    chart_values = yaml.safe_load((EXAMPLES.parent / "shardq" / "values.yaml").read_text())
    service, _, rest = host.partition(".")
    assert service == naming.client_service(chart_values["cluster"]["name"])
    assert rest.endswith(".svc.cluster.local")
