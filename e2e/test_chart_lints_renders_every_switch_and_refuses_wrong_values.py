"""charts/shardq: `helm lint --strict` is clean, defaults render the operator and
nothing optional, each switch of values.yaml adds exactly its resources, and a wrong
value is refused by values.schema.json with a message naming it (helm names the field
by its JSON pointer: `/operator/replicas`)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from e2e.binaries import Binaries
from e2e.helm import CHART, EVERY_SWITCH, helm, kinds_and_names, only, render, template_args
from shardq.coordination.peer_credentials import MIN_SECRET_CHARACTERS

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

NAMESPACE = "shardq-system"
ALERTS = {
    "ShardqDeadLetters",
    "ShardqOldestMessageOverSla",
    "ShardqShardWithoutLeader",
    "ShardqShardUnderReplicated",
    "ShardqQueueFull",
    "ShardqOperatorNotReconciling",
    "ShardqLeaseRenewalsSlow",
    "ShardqCertificateExpiresSoon",
}
OPERATOR_METRICS_TLS = "operator.metricsTls.secretName=op-metrics-tls"
# What the defaults make: the operator, its rights, `helm test` and the uninstall hooks.
DEFAULTS = {
    ("ServiceAccount", "shardq-operator"),
    ("ClusterRole", "shardq-operator"),
    ("ClusterRole", "shardq-operator-crds"),
    ("ClusterRoleBinding", "shardq-operator"),
    ("ClusterRoleBinding", "shardq-operator-crds"),
    # To bind the servers of clusters that authenticate clients to system:auth-delegator.
    ("ClusterRole", "shardq-operator-client-auth"),
    ("ClusterRoleBinding", "shardq-operator-client-auth"),
    ("Deployment", "shardq-operator"),
    ("PodDisruptionBudget", "shardq-operator"),
    # The key the operator derives every cluster's peer secret from.
    ("Secret", "shardq-operator-peer-key"),
    ("Queue", "helm-test"),
    ("Pod", "shardq-test"),
    ("ServiceAccount", "shardq-cleanup"),
    ("Role", "shardq-cleanup"),
    ("RoleBinding", "shardq-cleanup"),
    # To list the Queues and ShardqClusters others made in every namespace served.
    ("ClusterRole", "shardq-cleanup"),
    ("ClusterRoleBinding", "shardq-cleanup"),
    ("Job", "shardq-cleanup-pre-delete"),
    ("Job", "shardq-cleanup-post-delete"),
}


def test_helm_lint_strict_is_clean_with_defaults_and_every_switch(binaries: Binaries) -> None:
    for sets in ((), EVERY_SWITCH, (*EVERY_SWITCH, OPERATOR_METRICS_TLS)):
        args = ["lint", "--strict", str(CHART)]
        for value in sets:
            args += ["--set", value]
        done = helm(binaries, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[WARNING]" not in done.stdout, done.stdout
        assert "[ERROR]" not in done.stdout, done.stdout


def test_defaults_render_the_operator_with_two_replicas_and_nothing_optional(binaries: Binaries) -> None:
    manifests = render(binaries, namespace=NAMESPACE)
    assert kinds_and_names(manifests) == DEFAULTS
    deployment = only(manifests, "Deployment")
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "localhost/shardq:0.1.0"
    assert container["args"][:2] == ["shardq", "operator"]
    assert f"--leader-lease-namespace={NAMESPACE}" in container["args"]
    assert "--metrics-port=9700" in container["args"]
    assert not [arg for arg in container["args"] if arg.startswith("--namespace")], "all namespaces by default"
    assert {"name": "metrics", "containerPort": 9700} in container["ports"]
    assert [env["name"] for env in container["env"]] == ["POD_NAME"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "shardq-operator"
    assert_reads_its_peer_key_from(deployment, "shardq-operator-peer-key")
    key = only(manifests, "Secret")["data"]["key"]
    assert len(base64.b64decode(key)) >= MIN_SECRET_CHARACTERS


def assert_reads_its_peer_key_from(deployment: dict[str, Any], secret: str) -> None:
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (path,) = [arg.removeprefix("--peer-key-file=") for arg in container["args"] if arg.startswith("--peer-key-file=")]
    (mount,) = [mount for mount in container["volumeMounts"] if path.startswith(mount["mountPath"] + "/")]
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == secret
    assert path == f"{mount['mountPath']}/key"
    # The operator runs as 65534: the kubelet hands the files to its group.
    assert volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_a_peer_key_of_the_users_replaces_the_one_the_chart_makes(binaries: Binaries) -> None:
    manifests = render(binaries, "operator.peerKeySecret=mine")
    assert kinds_and_names(manifests) == DEFAULTS - {("Secret", "shardq-operator-peer-key")}
    assert_reads_its_peer_key_from(only(manifests, "Deployment"), "mine")


@pytest.mark.parametrize(
    ("switch", "added"),
    [
        ("cluster.create=true", {("ShardqCluster", "default")}),
        ("examples.enabled=true", {("Queue", "orders"), ("Queue", "orders-dlq")}),
        ("monitoring.podMonitor.enabled=true", {("PodMonitor", "shardq-servers"), ("PodMonitor", "shardq-operator")}),
        ("monitoring.prometheusRule.enabled=true", {("PrometheusRule", "shardq")}),
        ("monitoring.dashboard.enabled=true", {("ConfigMap", "shardq-dashboard")}),
        ("queues[0].name=audit", {("Queue", "audit")}),
        # The `helm test` Pod's identity, for a cluster that authenticates its clients.
        (
            "cluster.clientAuthentication.mode=kubernetes",
            {("ServiceAccount", "shardq-test"), ("Role", "shardq-test"), ("RoleBinding", "shardq-test")},
        ),
        # TLS changes what is rendered (the cluster's spec, the test Pod), adds nothing:
        # the Secret is the user's (or cert-manager's).
        ("cluster.tls.secretName=shardq-tls", set()),
        # So does the operator's: its Deployment mounts the user's Secret.
        (OPERATOR_METRICS_TLS, set()),
    ],
)
def test_each_switch_adds_exactly_its_resources(binaries: Binaries, switch: str, added: set[tuple[str, str]]) -> None:
    assert kinds_and_names(render(binaries, switch)) == DEFAULTS | added


@pytest.mark.parametrize(
    ("switch", "removed"),
    [
        ("tests.enabled=false", {("Queue", "helm-test"), ("Pod", "shardq-test")}),
        (
            "cleanup.enabled=false",
            {
                ("ServiceAccount", "shardq-cleanup"),
                ("Role", "shardq-cleanup"),
                ("RoleBinding", "shardq-cleanup"),
                ("ClusterRole", "shardq-cleanup"),
                ("ClusterRoleBinding", "shardq-cleanup"),
                ("Job", "shardq-cleanup-pre-delete"),
                ("Job", "shardq-cleanup-post-delete"),
            },
        ),
        ("operator.podDisruptionBudget.enabled=false", {("PodDisruptionBudget", "shardq-operator")}),
        (
            "cleanup.leaveOtherClusters=true",
            {("ClusterRole", "shardq-cleanup"), ("ClusterRoleBinding", "shardq-cleanup")},
        ),
    ],
)
def test_each_default_part_can_be_switched_off(binaries: Binaries, switch: str, removed: set[tuple[str, str]]) -> None:
    assert kinds_and_names(render(binaries, switch)) == DEFAULTS - removed


def test_every_switch_renders_a_cluster_queues_and_monitoring_from_values(binaries: Binaries) -> None:
    manifests = render(binaries, *EVERY_SWITCH, "cluster.servers=5", "cluster.storage.size=20Gi")
    cluster = only(manifests, "ShardqCluster")
    assert cluster["spec"]["servers"] == 5
    assert cluster["spec"]["storage"] == {"size": "20Gi", "retainOnDelete": True}
    assert cluster["spec"]["image"] == "localhost/shardq:0.1.0"
    assert cluster["spec"]["clientAuthentication"] == {"mode": "kubernetes", "audience": "shardq"}
    assert cluster["spec"]["tls"] == {"secretName": "shardq-tls"}
    queues = {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "Queue"}
    assert queues["orders"]["redrivePolicy"] == {"deadLetterQueue": "orders-dlq", "maxReceiveCount": 5}
    assert queues["audit"] == {"cluster": "default", "fifo": True}
    assert all(spec["cluster"] == "default" for spec in queues.values())
    rule = only(manifests, "PrometheusRule")
    alerts = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r}
    assert alerts == ALERTS
    dashboard = only(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["shardq.json"])["uid"] == "shardq-overview"


def test_the_operator_may_bind_only_the_auth_delegator_role_and_manage_bindings(binaries: Binaries) -> None:
    """What the operator needs for clusters that authenticate their clients (it applies,
    reads and deletes their servers' ClusterRoleBinding), bound cluster-wide whatever
    namespaces it serves: the binding is cluster-scoped."""
    for sets in ((), ("operator.watchNamespaces={shop}",)):
        manifests = render(binaries, *sets, namespace=NAMESPACE)
        named = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
        role = named[("ClusterRole", "shardq-operator-client-auth")]
        assert role["rules"] == [
            {
                "apiGroups": ["rbac.authorization.k8s.io"],
                "resources": ["clusterrolebindings"],
                "verbs": ["get", "create", "patch", "delete"],
            },
            {
                "apiGroups": ["rbac.authorization.k8s.io"],
                "resources": ["clusterroles"],
                "resourceNames": ["system:auth-delegator"],
                "verbs": ["bind"],
            },
        ]
        binding = named[("ClusterRoleBinding", "shardq-operator-client-auth")]
        assert binding["roleRef"]["name"] == "shardq-operator-client-auth"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shardq-operator", "namespace": NAMESPACE}]
    assert not [m for m in render(binaries, "rbac.create=false") if "client-auth" in m["metadata"]["name"]]


def test_the_helm_test_pod_sends_with_a_token_for_the_clusters_audience_when_clients_are_authenticated(
    binaries: Binaries,
) -> None:
    plain = only(render(binaries, "cluster.create=true"), "Pod")["spec"]
    assert "volumes" not in plain
    assert "serviceAccountName" not in plain
    assert "SHARDQ_TOKEN_FILE" not in str(plain)

    manifests = render(
        binaries,
        "cluster.create=true",
        "cluster.clientAuthentication.mode=kubernetes",
        "cluster.clientAuthentication.audience=shardq.example.com",
        "tests.queue=smoke",
        namespace=NAMESPACE,
    )
    cluster = only(manifests, "ShardqCluster")
    assert cluster["spec"]["clientAuthentication"] == {"mode": "kubernetes", "audience": "shardq.example.com"}
    pod = only(manifests, "Pod")["spec"]
    assert pod["serviceAccountName"] == "shardq-test"
    (container,) = pod["containers"]
    (path,) = [env["value"] for env in container["env"] if env["name"] == "SHARDQ_TOKEN_FILE"]
    (mount,) = [mount for mount in container["volumeMounts"] if path.startswith(mount["mountPath"] + "/")]
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == mount["name"]]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "shardq.example.com"
    assert path == f"{mount['mountPath']}/{source['serviceAccountToken']['path']}"
    # Only the projected token: not the one for the API server.
    assert pod["automountServiceAccountToken"] is False
    (role,) = [m for m in manifests if m["kind"] == "Role" and m["metadata"]["name"] == "shardq-test"]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["shardq.io"], "resources": ["queues"], "resourceNames": ["smoke"], "verbs": ["send", "receive"]}
    ]
    (binding,) = [m for m in manifests if m["kind"] == "RoleBinding" and m["metadata"]["name"] == "shardq-test"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "shardq-test"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shardq-test", "namespace": NAMESPACE}]


def test_the_helm_test_pod_trusts_the_clusters_ca_when_it_serves_tls(binaries: Binaries) -> None:
    plain = only(render(binaries, "cluster.create=true"), "Pod")["spec"]
    assert "SHARDQ_CA_FILE" not in str(plain)
    assert "tls" not in only(render(binaries, "cluster.create=true"), "ShardqCluster")["spec"]

    manifests = render(binaries, "cluster.create=true", "cluster.tls.secretName=shardq-tls", namespace=NAMESPACE)
    assert only(manifests, "ShardqCluster")["spec"]["tls"] == {"secretName": "shardq-tls"}
    pod = only(manifests, "Pod")["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    path = env["SHARDQ_CA_FILE"]
    (mount,) = [mount for mount in container["volumeMounts"] if path.startswith(mount["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == mount["name"]]
    # The CA only: the test Pod never sees the servers' key.
    assert volume["secret"]["secretName"] == "shardq-tls"
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": path.removeprefix(mount["mountPath"] + "/")}]
    # Readable by the Pod's user (65534), which owns no file of the volume.
    assert volume["secret"]["defaultMode"] & 0o004
    # It calls the client Service by the name the certificate carries: no server name override.
    assert env["ENDPOINT"] == f"default-shardq.{NAMESPACE}.svc.cluster.local:7600"
    assert "SHARDQ_TLS_SERVER_NAME" not in env
    # A token too, when the cluster also authenticates its clients.
    both = only(
        render(
            binaries,
            "cluster.create=true",
            "cluster.tls.secretName=shardq-tls",
            "cluster.clientAuthentication.mode=kubernetes",
        ),
        "Pod",
    )["spec"]
    assert {volume["name"] for volume in both["volumes"]} == {"shardq-token", "shardq-ca"}
    assert {"SHARDQ_TOKEN_FILE", "SHARDQ_CA_FILE"} <= {item["name"] for item in both["containers"][0]["env"]}


def operator_pod_monitor_endpoint(manifests: list[dict[str, Any]], operator: str) -> dict[str, Any]:
    (monitor,) = [m for m in manifests if m["kind"] == "PodMonitor" and m["metadata"]["name"] == operator]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    return endpoint


def test_the_operator_serves_metrics_over_https_from_its_secret_and_its_podmonitor_trusts_the_ca(
    binaries: Binaries,
) -> None:
    manifests = render(binaries, OPERATOR_METRICS_TLS, "monitoring.podMonitor.enabled=true", namespace=NAMESPACE)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--metrics-tls-cert-file=/etc/shardq-operator/metrics-tls/tls.crt" in container["args"]
    assert "--metrics-tls-key-file=/etc/shardq-operator/metrics-tls/tls.key" in container["args"]
    (mount,) = [
        mount for mount in container["volumeMounts"] if mount["mountPath"] == "/etc/shardq-operator/metrics-tls"
    ]
    # The whole Secret, not a subPath: the kubelet never updates a subPath, and a renewal
    # would not reach the operator.
    assert "subPath" not in mount
    assert mount["readOnly"] is True
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == mount["name"]]
    # Group-readable: the operator (65534) owns no file of the volume, its group does.
    assert volume["secret"] == {"secretName": "op-metrics-tls", "defaultMode": 0o440}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics", "scheme": "HTTPS"}, probe
    endpoint = operator_pod_monitor_endpoint(manifests, "shardq-operator")
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "op-metrics-tls", "key": "ca.crt"}},
        "serverName": f"shardq-operator.{NAMESPACE}.svc",
    }
    # The servers are scraped as before: the operator's TLS is not theirs.
    (servers,) = [m for m in manifests if m["kind"] == "PodMonitor" and m["metadata"]["name"] == "shardq-servers"]
    assert all("tlsConfig" not in server for server in servers["spec"]["podMetricsEndpoints"])


def test_the_operators_metrics_server_name_is_its_deployments_unless_one_is_given(binaries: Binaries) -> None:
    # A release whose name lacks `shardq` names its operator <release>-shardq-operator.
    manifests = render(
        binaries, OPERATOR_METRICS_TLS, "monitoring.podMonitor.enabled=true", namespace="mq", release="east"
    )
    assert only(manifests, "Deployment")["metadata"]["name"] == "east-shardq-operator"
    endpoint = operator_pod_monitor_endpoint(manifests, "east-shardq-operator")
    assert endpoint["tlsConfig"]["serverName"] == "east-shardq-operator.mq.svc"

    manifests = render(
        binaries,
        OPERATOR_METRICS_TLS,
        "operator.metricsTls.serverName=metrics.example.com",
        "monitoring.podMonitor.enabled=true",
        namespace="mq",
        release="east",
    )
    endpoint = operator_pod_monitor_endpoint(manifests, "east-shardq-operator")
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "op-metrics-tls", "key": "ca.crt"}},
        "serverName": "metrics.example.com",
    }


def test_without_a_metrics_secret_the_operator_is_probed_and_scraped_in_plaintext(binaries: Binaries) -> None:
    # A server name alone changes nothing: there is no certificate to check it against.
    for sets in ((), ("operator.metricsTls.serverName=metrics.example.com",)):
        manifests = render(binaries, *sets, "monitoring.podMonitor.enabled=true", namespace=NAMESPACE)
        pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert not [arg for arg in container["args"] if arg.startswith("--metrics-tls")], sets
        assert not [mount for mount in container["volumeMounts"] if "metrics-tls" in mount["mountPath"]], sets
        assert {volume["name"] for volume in pod["volumes"]} == {"tmp", "peer-key"}, sets
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"].get("scheme", "HTTP") == "HTTP", (sets, probe)
        endpoint = operator_pod_monitor_endpoint(manifests, "shardq-operator")
        assert "scheme" not in endpoint, sets
        assert "tlsConfig" not in endpoint, sets


def test_each_alert_can_be_turned_off_alone(binaries: Binaries) -> None:
    keys = {
        "ShardqDeadLetters": "deadLetters",
        "ShardqOldestMessageOverSla": "oldestMessage",
        "ShardqShardWithoutLeader": "shardWithoutLeader",
        "ShardqShardUnderReplicated": "underReplicated",
        "ShardqQueueFull": "queueFull",
        "ShardqOperatorNotReconciling": "operatorNotReconciling",
        "ShardqLeaseRenewalsSlow": "leaseRenewals",
    }
    for alert, key in keys.items():
        manifests = render(
            binaries,
            "monitoring.prometheusRule.enabled=true",
            f"monitoring.prometheusRule.alerts.{key}.enabled=false",
        )
        groups = only(manifests, "PrometheusRule")["spec"]["groups"]
        assert {r["alert"] for g in groups for r in g["rules"] if "alert" in r} == ALERTS - {alert}


def test_watching_named_namespaces_binds_the_rights_there_only(binaries: Binaries) -> None:
    manifests = render(binaries, "operator.watchNamespaces={shop,billing}", namespace=NAMESPACE)
    names = kinds_and_names(manifests)
    assert ("ClusterRoleBinding", "shardq-operator") not in names
    bindings = sorted(m["metadata"]["namespace"] for m in manifests if m["kind"] == "RoleBinding")
    # The served namespaces, the release's (the leader Lease), and the cleanup hook's: in
    # the release's, and in each served one to look for Queues and clusters others made.
    assert bindings == sorted(["shop", "billing", NAMESPACE, NAMESPACE, "shop", "billing"])
    assert ("ClusterRoleBinding", "shardq-cleanup") not in names
    (looking,) = [m for m in manifests if m["kind"] == "Role" and m["metadata"]["namespace"] == "shop"]
    assert looking["rules"] == [
        {"apiGroups": ["shardq.io"], "resources": ["queues", "shardqclusters"], "verbs": ["list"]}
    ]
    pre_delete = next(m for m in manifests if m["metadata"]["name"] == "shardq-cleanup-pre-delete")
    # The namespaces served, whether to leave others' clusters, and the release's cluster (none).
    assert pre_delete["spec"]["template"]["spec"]["containers"][0]["args"][-3:] == ["shop,billing", "false", ""]
    (container,) = only(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--namespace=shop" in container["args"]
    assert "--namespace=billing" in container["args"]


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        ("operator.replicas=two", "/operator/replicas"),
        ("operator.replicas=0", "/operator/replicas"),
        ("operator.leaderLeaseDuration=5 seconds", "/operator/leaderLeaseDuration"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("cluster.servers=0", "/cluster/servers"),
        ("cluster.name=Not_A_Label", "/cluster/name"),
        ("cluster.storage.size=lots", "/cluster/storage/size"),
        ("cluster.rebalance.mode=sometimes", "/cluster/rebalance/mode"),
        ("cluster.clientAuthentication.mode=tls", "/cluster/clientAuthentication/mode"),
        ("cluster.clientAuthentication.audience=", "/cluster/clientAuthentication/audience"),
        ("cluster.clientAuthentication.audience=two words", "/cluster/clientAuthentication/audience"),
        ("cluster.tls.secretName=Not_A_Name", "/cluster/tls/secretName"),
        ("cluster.tls.secret=shardq-tls", "'secret' not allowed"),
        ("operator.metricsTls.secretName=true", "/operator/metricsTls/secretName"),
        ("operator.metricsTls.secretName=Not_A_Name", "/operator/metricsTls/secretName"),
        ("operator.metricsTls.serverName=not a name", "/operator/metricsTls/serverName"),
        ("operator.metricsTls.secret=op-metrics-tls", "at '/operator/metricsTls': additional properties 'secret'"),
        ("monitoring.podMonitor.enable=true", "'enable' not allowed"),
        (
            "monitoring.prometheusRule.alerts.queueFull.severity=page",
            "/monitoring/prometheusRule/alerts/queueFull/severity",
        ),
        (
            "monitoring.prometheusRule.alerts.oldestMessage.perQueue.orders=soon",
            "/monitoring/prometheusRule/alerts/oldestMessage/perQueue/orders",
        ),
        ("queues[0].name=Orders", "/queues/0/name"),
        ("tests.queue=", "/tests/queue"),
    ],
)
def test_a_wrong_value_is_refused_naming_it(binaries: Binaries, wrong: str, named: str) -> None:
    done = helm(binaries, *template_args(wrong))
    assert done.returncode != 0, f"{wrong} was accepted"
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert named in done.stderr, done.stderr
    assert done.stdout == "", "nothing is rendered"
