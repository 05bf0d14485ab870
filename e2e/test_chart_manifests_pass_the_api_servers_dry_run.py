"""Everything the chart renders (every switch on, hooks and tests included) is accepted by
the real API server's server-side dry run with strict field validation, and the
operator's ClusterRole is enough for what the operator writes and reads, and no more.

The Prometheus Operator's kinds (PodMonitor, PrometheusRule) have no CRD on this test
control plane (no network to fetch one), so they are checked against a small CRD written
here: the monitoring.coreos.com/v1 fields the chart uses, typed as upstream types them,
nothing else (strict validation refuses any other field)."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from shardq_operator import builders

from e2e.binaries import Binaries, require
from e2e.helm import CHART, EVERY_SWITCH, helm, render
from e2e.polling import wait_for
from shardq.coordination.cluster_map import ClusterMap

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]

GROUP, VERSION = "shardq.io", "v1alpha1"
_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_NAME = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABELING = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": _LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "type": "string",
            "enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase",
                     "uppercase", "keepequal", "dropequal"],
        },
    },
}  # fmt: skip
_KEY_SELECTOR = {
    "type": "object",
    "required": ["key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
}
# SafeTLSConfig, as a PodMonitor endpoint's tlsConfig is typed upstream (the fields the chart may use).
_SAFE_TLS_CONFIG = {
    "type": "object",
    "properties": {
        "ca": {"type": "object", "properties": {"secret": _KEY_SELECTOR, "configMap": _KEY_SELECTOR}},
        "serverName": {"type": "string"},
        "insecureSkipVerify": {"type": "boolean"},
    },
}
_POD_MONITOR_SPEC = {
    "type": "object",
    "required": ["selector", "podMetricsEndpoints"],
    "properties": {
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "selector": {"type": "object", "properties": {"matchLabels": _STRING_MAP}},
        "namespaceSelector": {
            "type": "object",
            "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
        },
        "podMetricsEndpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string"},
                    "scheme": {"type": "string", "enum": ["http", "https"]},
                    "tlsConfig": _SAFE_TLS_CONFIG,
                    "interval": _DURATION,
                    "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": _RELABELING},
                    "metricRelabelings": {"type": "array", "items": _RELABELING},
                },
            },
        },
    },
}
_PROMETHEUS_RULE_SPEC = {
    "type": "object",
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": _DURATION,
                    "rules": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["expr"],
                            "x-kubernetes-validations": [
                                {"rule": "has(self.record) != has(self.alert)", "message": "a rule records or alerts"}
                            ],
                            "properties": {
                                "record": {"type": "string"},
                                "alert": {"type": "string"},
                                "expr": {"type": "string", "minLength": 1},
                                "for": _DURATION,
                                "keep_firing_for": _DURATION,
                                "labels": _STRING_MAP,
                                "annotations": _STRING_MAP,
                            },
                        },
                    },
                },
            },
        }
    },
}


def monitoring_crd(kind: str, spec_schema: dict[str, Any]) -> dict[str, Any]:
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {"spec": spec_schema},
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def monitoring_crds(api_client: client.ApiClient) -> Iterator[None]:
    extensions = client.ApiextensionsV1Api(api_client)
    crds = [monitoring_crd("PodMonitor", _POD_MONITOR_SPEC), monitoring_crd("PrometheusRule", _PROMETHEUS_RULE_SPEC)]
    for crd in crds:
        extensions.create_custom_resource_definition(crd)

    def established() -> bool:
        for crd in crds:
            status = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status
            if not any(c.type == "Established" and c.status == "True" for c in (status.conditions or [])):
                return False
        return True

    wait_for(established, timeout=60, what="the monitoring CRDs established")
    yield
    for crd in crds:
        extensions.delete_custom_resource_definition(crd["metadata"]["name"])


def kubectl(
    binaries: Binaries, kubeconfig: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    require(binaries.kubectl)
    return subprocess.run(
        [str(binaries.kubectl), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def dry_run(binaries: Binaries, kubeconfig: Path, manifests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return kubectl(
        binaries,
        kubeconfig,
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-o",
        "name",
        "-f",
        "-",
        stdin=yaml.safe_dump_all(manifests),
    )


def wait_for_default_account(api_client: client.ApiClient, namespace: str) -> None:
    """Pods are admitted only once the namespace's `default` ServiceAccount exists."""
    core = client.CoreV1Api(api_client)
    wait_for(
        lambda: core.read_namespaced_service_account("default", namespace),
        timeout=30,
        what=f"the default ServiceAccount of {namespace}",
        retry_on=(ApiException,),
    )


@pytest.mark.usefixtures("shardq_crds", "monitoring_crds")
def test_every_rendered_manifest_passes_a_strict_server_side_dry_run(
    binaries: Binaries, kubeconfig: Path, api_client: client.ApiClient, namespace: str
) -> None:
    wait_for_default_account(api_client, namespace)
    # With the operator's metrics TLS too: the Deployment's https probes and Secret volume,
    # the operator PodMonitor's tlsConfig.
    with_operator_metrics_tls = (*EVERY_SWITCH, "operator.metricsTls.secretName=shardq-operator-metrics-tls")
    for sets in ((), EVERY_SWITCH, with_operator_metrics_tls, ("operator.watchNamespaces={" + namespace + "}",)):
        manifests = render(binaries, *sets, namespace=namespace)
        # A Pod is admitted only once its ServiceAccount exists, and a dry run stores
        # nothing: they are made first, as `helm install` makes them before `helm test`
        # runs its Pod (that of a cluster authenticating clients has one of its own).
        accounts = [m for m in manifests if m["kind"] == "ServiceAccount"]
        made = kubectl(binaries, kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(accounts))
        assert made.returncode == 0, made.stderr
        done = dry_run(binaries, kubeconfig, manifests)
        assert done.returncode == 0, f"{sets}:\n{done.stderr}"
        accepted = done.stdout.split()
        assert len(accepted) == len(manifests), done.stdout
    kinds = {m["kind"] for m in render(binaries, *EVERY_SWITCH, namespace=namespace)}
    assert {"PodMonitor", "PrometheusRule", "ShardqCluster", "Queue", "ConfigMap", "Deployment", "Job"} <= kinds


@pytest.mark.usefixtures("shardq_crds", "monitoring_crds")
@pytest.mark.parametrize(
    ("kind", "breakage", "said"),
    [
        ("PodMonitor", lambda m: m["spec"].update(podMetricEndpoints=[]), 'unknown field "spec.podMetricEndpoints"'),
        ("PodMonitor", lambda m: m["spec"]["podMetricsEndpoints"][0].update(interval="15 s"), "interval"),
        (
            "PrometheusRule",
            lambda m: m["spec"]["groups"][0]["rules"][0].update(alert="Both"),
            "a rule records or alerts",
        ),
        ("ShardqCluster", lambda m: m["spec"].update(servers=0), "spec.servers"),
        ("Deployment", lambda m: m["spec"]["template"]["spec"].update(serviceAcountName="x"), "serviceAcountName"),
    ],
)
def test_the_dry_run_refuses_a_broken_manifest(
    binaries: Binaries,
    kubeconfig: Path,
    api_client: client.ApiClient,
    namespace: str,
    kind: str,
    breakage: Any,
    said: str,
) -> None:
    """The dry run above can fail: each kind is really checked against its schema."""
    wait_for_default_account(api_client, namespace)
    manifests = render(binaries, *EVERY_SWITCH, namespace=namespace)
    (target,) = [m for m in manifests if m["kind"] == kind][:1]
    breakage(target)
    done = dry_run(binaries, kubeconfig, [target])
    assert done.returncode != 0
    assert said in done.stderr, done.stderr


def test_the_operator_role_covers_what_it_writes_and_reads_and_no_more(
    binaries: Binaries, kubeconfig: Path, api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    """The ClusterRole as installed (a real ClusterRoleBinding to the chart's
    ServiceAccount): every object the operator's builders make is applied as the operator
    applies it (server-side apply, its field manager, in order: the RoleBinding needs its
    Role) and accepted, escalation checks included: the servers' ClusterRoleBinding to
    system:auth-delegator too, which the operator may bind without holding its rights,
    and then read and delete as it does; no other ClusterRole may it bind; the reads and
    writes of kube.py and kopf are allowed; nothing else is."""
    release = f"rbac-{uuid.uuid4().hex[:6]}"
    rights = [
        m
        for m in render(binaries, namespace=namespace, release=release)
        if m["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding") and "helm.sh/hook" not in str(m)
    ]
    account = f"system:serviceaccount:{namespace}:{release}-shardq-operator"
    created = kubectl(binaries, kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(rights))
    assert created.returncode == 0, created.stderr
    try:
        custom = client.CustomObjectsApi(api_client)
        owner = custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "shardqclusters",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ShardqCluster", "metadata": {"name": "main"},
             "spec": {"servers": 3}},
        )  # fmt: skip
        # A cluster serving TLS: its servers mount the Secret it names (the StatefulSet's
        # applied twice, as it is when spec.tls is added).
        tls_owner = {**owner, "spec": {**owner["spec"], "tls": {"secretName": "main-tls"}}}
        queue = custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "queues",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Queue", "metadata": {"name": "orders"},
             "spec": {"cluster": "main", "shards": 1}},
        )  # fmt: skip
        built = [
            builders.service_account(owner),
            builders.role(owner),
            builders.role_binding(owner),
            builders.map_config(owner, ClusterMap(servers={}, queues=[], placement={})),
            builders.peers_service(owner),
            builders.client_service(owner),
            builders.disruption_budget(owner),
            builders.stateful_set(owner, servers=3),
            builders.stateful_set(tls_owner, servers=3),
            builders.shard(queue, index=0, replicas=["main-shardq-0"]),
            builders.auth_delegator_binding(owner),
        ]
        delegation = builders.auth_delegator_binding(owner)["metadata"]["name"]

        def apply_as(who: str, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
            return kubectl(
                binaries, kubeconfig, "apply", "--server-side", "--force-conflicts",
                "--field-manager=shardq-operator", f"--as={who}", "-f", "-",
                stdin=json.dumps(manifest),
            )  # fmt: skip

        for manifest in built:
            done = apply_as(account, manifest)
            assert done.returncode == 0, f"{manifest['kind']}: {done.stderr}"
        # The check can fail: an account without the role may not write any of it.
        refused = apply_as(f"system:serviceaccount:{namespace}:default", builders.peers_service(owner))
        assert refused.returncode != 0
        assert "forbidden" in refused.stderr.lower()
        # Only system:auth-delegator may be bound: the same binding to another role is refused.
        to_admin = builders.auth_delegator_binding(owner)
        to_admin["metadata"]["name"] += "-admin"
        to_admin["roleRef"]["name"] = "cluster-admin"
        escalating = apply_as(account, to_admin)
        assert escalating.returncode != 0, "the operator bound cluster-admin"
        assert "attempting to grant RBAC permissions not currently held" in escalating.stderr, escalating.stderr
        # Read, then deleted, as kube.delete_cluster_role_binding does.
        for verb in ("get", "delete"):
            done = kubectl(binaries, kubeconfig, verb, "clusterrolebinding", delegation, f"--as={account}")
            assert done.returncode == 0, f"{verb}: {done.stderr}"

        def can(verb: str, resource: str, *flags: str) -> bool:
            done = kubectl(binaries, kubeconfig, "auth", "can-i", verb, resource, f"--as={account}", *flags)
            return done.stdout.strip() == "yes"

        here = ("-n", namespace)
        allowed = [
            ("watch", "shardqclusters.shardq.io", "--all-namespaces"),
            ("watch", "queues.shardq.io", "--all-namespaces"),
            ("patch", "queues.shardq.io", *here),
            ("patch", "shardqclusters.shardq.io", "--subresource=status", *here),
            ("patch", "queues.shardq.io", "--subresource=status", *here),
            ("patch", "shards.shardq.io", "--subresource=status", *here),
            ("list", "shardqclusters.shardq.io", *here),
            ("list", "pods", *here),
            ("get", "configmaps", *here),
            ("create", "leases.coordination.k8s.io", *here),
            ("patch", "leases.coordination.k8s.io", *here),
            ("get", "leases.coordination.k8s.io", *here),
            ("create", "events", *here),
            ("list", "customresourcedefinitions.apiextensions.k8s.io"),
            # Each cluster's peer Secret, written by server-side apply and never read.
            ("create", "secrets", *here),
            ("patch", "secrets", *here),
            # A TLS cluster's Secret (spec.tls.secretName), read by name for its ca.crt.
            ("get", "secrets", *here),
            # Servers that authenticate clients: their binding to system:auth-delegator.
            ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("patch", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("get", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("delete", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/system:auth-delegator"),
        ]
        denied = [
            ("list", "secrets", *here),
            ("watch", "secrets", *here),
            ("create", "pods", *here),
            ("delete", "pods", *here),
            ("delete", "statefulsets.apps", *here),
            ("delete", "queues.shardq.io", *here),
            ("delete", "leases.coordination.k8s.io", *here),
            ("escalate", "roles.rbac.authorization.k8s.io", *here),
            ("bind", "roles.rbac.authorization.k8s.io", *here),
            ("create", "clusterroles.rbac.authorization.k8s.io"),
            ("update", "customresourcedefinitions.apiextensions.k8s.io"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/admin"),
            ("escalate", "clusterroles.rbac.authorization.k8s.io"),
            ("list", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("watch", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("update", "clusterrolebindings.rbac.authorization.k8s.io"),
            # The operator makes no reviews itself: it binds the right, it does not hold it.
            ("create", "tokenreviews.authentication.k8s.io"),
            ("create", "subjectaccessreviews.authorization.k8s.io"),
        ]
        assert [check for check in allowed if not can(*check)] == []
        assert [check for check in denied if can(*check)] == []
    finally:
        for manifest in rights:
            if manifest["kind"] != "ServiceAccount":
                kubectl(binaries, kubeconfig, "delete", manifest["kind"].lower(), manifest["metadata"]["name"])
        # Cluster-scoped: the namespace's deletion would leave them.
        for name in (f"shardq:{namespace}:main:auth-delegator", f"shardq:{namespace}:main:auth-delegator-admin"):
            kubectl(binaries, kubeconfig, "delete", "clusterrolebinding", name, "--ignore-not-found")


def test_helm_install_refuses_a_wrong_value_naming_it_and_installs_nothing(
    binaries: Binaries, kubeconfig: Path, namespace: str
) -> None:
    kube = ("--kubeconfig", str(kubeconfig), "--namespace", namespace)
    done = helm(binaries, "install", "wrong", CHART, *kube, "--set", "cluster.servers=many")
    assert done.returncode != 0
    assert "at '/cluster/servers': got string, want integer" in done.stderr, done.stderr
    assert helm(binaries, "list", "--short", "--all", *kube).stdout.strip() == ""
