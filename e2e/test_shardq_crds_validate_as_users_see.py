"""shardq's CRDs on a real API server: defaults filled in, bad objects refused with a
message a person understands (each CEL rule), immutable fields kept, printer columns."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.binaries import Binaries, require

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]

GROUP, VERSION = "shardq.io", "v1alpha1"


def create(api: client.ApiClient, namespace: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> Any:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    # Strict, as kubectl apply validates by default: an unknown field is an error, not dropped.
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, body, field_validation="Strict"
    )


def refused(api: client.ApiClient, namespace: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as raised:
        create(api, namespace, plural, kind, name, spec)
    # 422 for a schema or CEL rule; 400 for an unknown field (strict decoding)
    assert raised.value.status in (400, 422), raised.value.body
    return str(raised.value.body)


def test_a_minimal_cluster_and_queue_get_their_defaults(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    cluster = create(api_client, namespace, "shardqclusters", "ShardqCluster", "default", {})
    assert cluster["spec"]["servers"] == 3
    assert cluster["spec"]["storage"] == {"size": "1Gi", "retainOnDelete": True}
    assert cluster["spec"]["rebalance"] == {
        "mode": "auto",
        "maxMovesPerMinute": 6,
        "imbalanceThreshold": 1.5,
        "maxReplicaMovesInFlight": 4,
    }
    assert cluster["spec"]["leaseDuration"] == "10s"
    # Clients are not authenticated unless asked for.
    assert cluster["spec"]["clientAuthentication"] == {"mode": "none", "audience": "shardq"}
    queue = create(api_client, namespace, "queues", "Queue", "orders", {"visibilityTimeout": "45s"})
    assert queue["spec"] == {
        "cluster": "default",
        "shards": 1,
        "replicas": 3,
        "fifo": False,
        "visibilityTimeout": "45s",
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"visibilityTimeout": "soon"}, "must be a duration such as 30s"),
        ({"retention": "4 days"}, "must be a duration such as 30s"),
        ({"shards": 0}, "should be greater than or equal to 1"),
        ({"replicas": 9}, "should be less than or equal to 7"),
        (
            {"redrivePolicy": {"deadLetterQueue": "", "maxReceiveCount": 3}},
            "names the queue that receives dead letters",
        ),
        ({"redrivePolicy": {"deadLetterQueue": "dlq"}}, "maxReceiveCount: Required value"),
        ({"priorityLanes": 11}, "should be less than or equal to 10"),
        ({"receiveWait": "a while"}, "must be a duration such as 30s"),
        ({"contentBasedDedup": "yes"}, "must be of type boolean"),
        ({"colour": "blue"}, "spec.colour"),
    ],
)
def test_a_bad_queue_is_refused_with_a_message_naming_the_problem(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], spec: dict[str, Any], message: str
) -> None:
    body = refused(api_client, namespace, "queues", "Queue", "orders", spec)
    assert message in body, body
    if "colour" in message:
        assert "unknown field" in body


def test_a_queue_takes_priority_lanes_a_receive_wait_and_content_based_dedup(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    spec = {"priorityLanes": 10, "receiveWait": "20s", "contentBasedDedup": True}
    queue = create(api_client, namespace, "queues", "Queue", "jobs", spec)
    assert {key: queue["spec"][key] for key in spec} == spec


def test_a_queue_name_must_be_a_dns_label(api_client: client.ApiClient, namespace: str, shardq_crds: list[str]) -> None:
    body = refused(api_client, namespace, "queues", "Queue", "orders.v2", {})
    assert "a Queue's name is the queue's name: a DNS label" in body


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"leaseDuration": "ten seconds"}, "leaseDuration must be a duration"),
        ({"servers": 0}, "should be greater than or equal to 1"),
        ({"storage": {"size": "0"}}, "storage.size must be a positive quantity"),
        ({"rebalance": {"mode": "sometimes"}}, "Unsupported value"),
        ({"clientAuthentication": {"mode": "tls"}}, "spec.clientAuthentication.mode: Unsupported value"),
        ({"clientAuthentication": {"mode": "Kubernetes"}}, "spec.clientAuthentication.mode: Unsupported value"),
        ({"clientAuthentication": {"audience": ""}}, "spec.clientAuthentication.audience"),
        ({"clientAuthentication": {"audience": "a" * 254}}, "spec.clientAuthentication.audience"),
        (
            {"clientAuthentication": {"mode": "kubernetes", "audience": "two words"}},
            "clientAuthentication.audience must be one word: no spaces",
        ),
        ({"clientAuthentication": {"audience": "tab\there"}}, "clientAuthentication.audience must be one word"),
        ({"clientAuthentication": {"mode": "kubernetes", "audiences": ["x"]}}, "spec.clientAuthentication.audiences"),
        ({"tls": {}}, "spec.tls.secretName: Required value"),
        ({"tls": {"secretName": ""}}, "spec.tls.secretName"),
        ({"tls": {"secretName": "Main_TLS"}}, "tls.secretName must be a Secret's name"),
        ({"tls": {"secretName": "main-tls", "caFile": "/ca.crt"}}, "spec.tls.caFile"),
    ],
)
def test_a_bad_cluster_is_refused_with_a_message_naming_the_problem(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], spec: dict[str, Any], message: str
) -> None:
    assert message in refused(api_client, namespace, "shardqclusters", "ShardqCluster", "main", spec)


def test_client_authentication_is_taken_and_its_audience_defaulted(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    cluster = create(
        api_client,
        namespace,
        "shardqclusters",
        "ShardqCluster",
        "main",
        {"clientAuthentication": {"mode": "kubernetes"}},
    )
    assert cluster["spec"]["clientAuthentication"] == {"mode": "kubernetes", "audience": "shardq"}
    other = create(
        api_client,
        namespace,
        "shardqclusters",
        "ShardqCluster",
        "other",
        {"clientAuthentication": {"mode": "kubernetes", "audience": "https://shardq.example.com/" + "a" * 226}},
    )
    assert len(other["spec"]["clientAuthentication"]["audience"]) == 253
    # The mode may change (the operator restarts the servers with it).
    changed = client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "shardqclusters", "main", {"spec": {"clientAuthentication": {"mode": "none"}}}
    )
    assert changed["spec"]["clientAuthentication"] == {"mode": "none", "audience": "shardq"}


def explained(binaries: Binaries, kubeconfig: Path, field: str) -> str:
    """What `kubectl explain shardqclusters.spec.FIELD` says, on one line."""
    done = subprocess.run(
        [str(binaries.kubectl), f"--kubeconfig={kubeconfig}", "explain", f"shardqclusters.spec.{field}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_kubectl_explain_says_what_client_authentication_does(
    binaries: Binaries, kubeconfig: Path, shardq_crds: list[str]
) -> None:
    require(binaries.kubectl)
    said = {field: explained(binaries, kubeconfig, f"clientAuthentication.{field}") for field in ("mode", "audience")}
    assert "ServiceAccount token" in said["mode"]
    assert "system:auth-delegator" in said["mode"]
    assert "send, receive, get, list, admin, export" in said["mode"]
    assert "projected serviceAccountToken" in said["audience"]


def test_tls_is_taken_and_may_be_added_changed_and_removed(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    plain = create(api_client, namespace, "shardqclusters", "ShardqCluster", "main", {})
    assert "tls" not in plain["spec"], "a cluster without tls must stay plaintext"
    secure = create(
        api_client, namespace, "shardqclusters", "ShardqCluster", "other", {"tls": {"secretName": "other.tls-1"}}
    )
    assert secure["spec"]["tls"] == {"secretName": "other.tls-1"}
    custom = client.CustomObjectsApi(api_client)
    added = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "shardqclusters", "main", {"spec": {"tls": {"secretName": "main-tls"}}}
    )
    assert added["spec"]["tls"] == {"secretName": "main-tls"}
    removed = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "shardqclusters", "main", {"spec": {"tls": None}}
    )
    assert "tls" not in removed["spec"]


def test_kubectl_explain_says_what_tls_needs(binaries: Binaries, kubeconfig: Path, shardq_crds: list[str]) -> None:
    require(binaries.kubectl)
    said = {field: explained(binaries, kubeconfig, field) for field in ("tls", "tls.secretName")}
    assert "Absent: plaintext" in said["tls"]
    assert "kubernetes.io/tls" in said["tls.secretName"]
    assert "tls.crt, tls.key and ca.crt" in said["tls.secretName"]
    assert "*.CLUSTER-shardq-peers.NAMESPACE.svc.cluster.local" in said["tls.secretName"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("fifo", True, "fifo cannot change"),
        ("shards", 4, "shards cannot change after the queue is created"),
        ("replicas", 1, "replicas cannot change"),
        ("cluster", "other", "cluster cannot change"),
    ],
)
def test_fields_fixed_at_creation_cannot_change(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], field: str, value: Any, message: str
) -> None:
    create(api_client, namespace, "queues", "Queue", "orders", {})
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(ApiException) as raised:
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "queues", "orders", {"spec": {field: value}})
    assert raised.value.status == 422
    assert message in str(raised.value.body)
    # A setting that may change does.
    changed = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "queues", "orders", {"spec": {"visibilityTimeout": "2m"}}
    )
    assert changed["spec"]["visibilityTimeout"] == "2m"


def test_printer_columns_and_the_status_subresource(api_client: client.ApiClient, shardq_crds: list[str]) -> None:
    extensions = client.ApiextensionsV1Api(api_client)
    queues = extensions.read_custom_resource_definition("queues.shardq.io").spec.versions[0]
    assert [column.name for column in queues.additional_printer_columns] == [
        "Cluster", "Shards", "Ready", "Visible", "In flight", "Oldest age", "Age",
    ]  # fmt: skip
    assert queues.subresources.status is not None
    shards = extensions.read_custom_resource_definition("shards.shardq.io").spec.versions[0]
    assert [column.name for column in shards.additional_printer_columns][:4] == ["Queue", "Index", "Leader", "Epoch"]


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"size": "2Gi"}, "storage.size cannot change after the cluster is created"),
        ({"storageClassName": "other"}, "storage.storageClassName cannot change after the cluster is created"),
    ],
)
def test_a_clusters_volumes_cannot_change(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], storage: dict[str, str], message: str
) -> None:
    """A StatefulSet's volume claim template is immutable: a storage edit the CRD let
    through made every apply of the operator fail, and failover with it."""
    create(api_client, namespace, "shardqclusters", "ShardqCluster", "main", {"storage": {"storageClassName": "local"}})
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(ApiException) as raised:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "shardqclusters", "main", {"spec": {"storage": storage}}
        )
    assert raised.value.status == 422
    assert message in str(raised.value.body)
    # What may change does.
    changed = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "shardqclusters", "main", {"spec": {"servers": 5}}
    )
    assert changed["spec"]["servers"] == 5
