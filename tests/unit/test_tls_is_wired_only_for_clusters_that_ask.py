"""A ShardqCluster's `spec.tls` as the operator carries it out: the server pods' Secret
volume, flags, health port and probe; the Secret checked before pods are rolled to it;
and how the operator's own calls reach each server (plaintext, or TLS checked against
the Secret's CA for the name its peers call it by)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from shardq_operator import builders, naming
from shardq_operator.server_reads import client_tls_of
from shardq_operator.transport_security import (
    CallTls,
    ServerTrust,
    TlsSecretProblem,
    call_tls_of,
    check_tls_secret,
    serving_tls_secret,
    tls_secret_name,
)

from shardq.coordination.peer_credentials import PeerCredential

CA_PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
CLUSTER: dict[str, Any] = {
    "apiVersion": "shardq.io/v1alpha1",
    "kind": "ShardqCluster",
    "metadata": {"name": "main", "namespace": "shop", "uid": "u-1"},
    "spec": {"servers": 3, "image": "localhost/shardq:abc", "imagePullPolicy": "Never"},
}
PEER = PeerCredential("s" * 43)

# The server pods' template exactly as the operator built it before TLS existed: a cluster
# without spec.tls must keep it byte for byte, or upgrading the operator restarts every pod.
PLAINTEXT_TEMPLATE: dict[str, Any] = {
    "metadata": {
        "annotations": {"shardq.io/peer-secret-digest": "d64b93c9f1b60eb3"},
        "labels": {
            "app.kubernetes.io/instance": "main",
            "app.kubernetes.io/managed-by": "shardq-operator",
            "app.kubernetes.io/name": "shardq-server",
        },
    },
    "spec": {
        "containers": [
            {
                "args": [
                    "shardq",
                    "serve",
                    "--data-dir",
                    "/data",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "7600",
                    "--metrics-port",
                    "9600",
                    "--server-id",
                    "$(POD_NAME)",
                    "--lease-store",
                    "kubernetes",
                    "--namespace",
                    "$(POD_NAMESPACE)",
                    "--cluster-configmap",
                    "main-shardq-map",
                    "--queues-managed-by",
                    "the Queue resources of namespace shop (kubectl apply)",
                    "--log-format",
                    "text",
                    "--peer-secret-file",
                    "/etc/shardq/peer/secret",
                ],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                ],
                "image": "localhost/shardq:abc",
                "imagePullPolicy": "Never",
                "name": "server",
                "ports": [{"containerPort": 7600, "name": "grpc"}, {"containerPort": 9600, "name": "metrics"}],
                "readinessProbe": {"failureThreshold": 3, "grpc": {"port": 7600}, "periodSeconds": 1},
                "volumeMounts": [
                    {"mountPath": "/data", "name": "data"},
                    {"mountPath": "/etc/shardq/peer", "name": "peer-secret", "readOnly": True},
                ],
            }
        ],
        "serviceAccountName": "main-shardq",
        "terminationGracePeriodSeconds": 15,
        "volumes": [{"name": "peer-secret", "secret": {"defaultMode": 0o400, "secretName": "main-shardq-peer"}}],
    },
}


def cluster_with(tls: dict[str, Any] | None) -> dict[str, Any]:
    cluster = copy.deepcopy(CLUSTER)
    if tls is not None:
        cluster["spec"]["tls"] = tls
    return cluster


def template(cluster: dict[str, Any]) -> dict[str, Any]:
    built: dict[str, Any] = builders.stateful_set(cluster, servers=3, credential=PEER)["spec"]["template"]
    return built


def secret(data: dict[str, bytes]) -> dict[str, Any]:
    """A Secret as Kube.read_secret_data returns it (values base64, as the API has them)."""
    return {"data": {key: base64.b64encode(value).decode() for key, value in data.items()}}


@pytest.mark.parametrize("tls", [None, {}, {"secretName": ""}])
def test_a_cluster_without_tls_keeps_the_pod_template_it_had_before_tls_existed(tls: Any) -> None:
    assert template(cluster_with(tls)) == PLAINTEXT_TEMPLATE
    assert tls_secret_name(cluster_with(tls)) is None


def test_servers_of_a_tls_cluster_mount_the_secret_serve_tls_and_are_probed_on_the_health_port() -> None:
    built = template(cluster_with({"secretName": "main-tls"}))
    (container,) = built["spec"]["containers"]
    args = container["args"]
    for flag, value in [
        ("--tls-cert-file", "/etc/shardq/tls/tls.crt"),
        ("--tls-key-file", "/etc/shardq/tls/tls.key"),
        ("--tls-ca-file", "/etc/shardq/tls/ca.crt"),
        ("--health-port", "7602"),
    ]:
        assert args.count(flag) == 1, flag
        assert args[args.index(flag) + 1] == value
    assert {"name": "health", "containerPort": naming.HEALTH_PORT} in container["ports"]
    assert container["readinessProbe"] == {"grpc": {"port": 7602}, "periodSeconds": 1, "failureThreshold": 3}
    assert {"name": "tls", "mountPath": "/etc/shardq/tls", "readOnly": True} in container["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "main-tls", "defaultMode": 0o400}} in built["spec"]["volumes"]
    # Everything else is as without TLS: the gRPC and metrics ports keep their numbers and names.
    plain = copy.deepcopy(PLAINTEXT_TEMPLATE)
    plain_container = plain["spec"]["containers"][0]
    assert args[: len(plain_container["args"])] == plain_container["args"]
    assert container["ports"][:2] == plain_container["ports"]
    assert built["spec"]["volumes"][:1] == plain["spec"]["volumes"]
    assert built["metadata"] == plain["metadata"]


def test_a_tls_cluster_without_a_peer_secret_still_gets_its_tls_volume() -> None:
    built = builders.stateful_set(cluster_with({"secretName": "main-tls"}), servers=3)["spec"]["template"]
    assert built["spec"]["volumes"] == [{"name": "tls", "secret": {"secretName": "main-tls", "defaultMode": 0o400}}]


def test_a_whole_tls_secret_gives_the_operator_its_ca() -> None:
    found = check_tls_secret("main-tls", "shop", secret({"tls.crt": b"c", "tls.key": b"k", "ca.crt": CA_PEM}))
    assert found == ServerTrust(ca_certificates=CA_PEM)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (None, "Secret main-tls (spec.tls.secretName) in namespace shop does not exist"),
        ({"tls.crt": b"c", "tls.key": b"k"}, "Secret main-tls (spec.tls.secretName) in namespace shop has no ca.crt"),
        ({"ca.crt": CA_PEM}, "has no tls.crt, tls.key"),
        ({"tls.crt": b"c", "tls.key": b"", "ca.crt": CA_PEM}, "has no tls.key"),
        ({"tls.crt": b"c", "tls.key": b"k", "ca.crt": b"not a certificate"}, "its ca.crt holds no PEM certificate"),
    ],
)
def test_a_missing_or_short_secret_is_named_with_the_key_it_lacks(data: dict[str, bytes] | None, said: str) -> None:
    found = check_tls_secret("main-tls", "shop", None if data is None else secret(data))
    assert isinstance(found, TlsSecretProblem)
    assert said in found.message


def pod(name: str, cluster: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": template(cluster)["spec"]}


def test_the_operator_calls_each_server_as_its_pod_serves_checked_for_its_peers_name() -> None:
    trusts: dict[str, ServerTrust | TlsSecretProblem] = {
        "main-tls": ServerTrust(CA_PEM),
        "old-tls": TlsSecretProblem("Secret old-tls is gone"),
    }
    secure = pod("main-shardq-1", cluster_with({"secretName": "main-tls"}))
    plain = pod("main-shardq-2", cluster_with(None))
    stale = pod("main-shardq-0", cluster_with({"secretName": "old-tls"}))
    unread = pod("main-shardq-3", cluster_with({"secretName": "never-read"}))
    assert serving_tls_secret(secure) == "main-tls"
    assert serving_tls_secret(plain) is None
    call = call_tls_of(secure, trusts, cluster="main", namespace="shop")
    assert call == CallTls(ca_certificates=CA_PEM, server_name="main-shardq-1.main-shardq-peers.shop.svc.cluster.local")
    # The name is the host its peers call it at (the cluster map's address), port aside.
    assert f"{call.server_name}:{naming.GRPC_PORT}" == naming.server_address("main", "shop", "main-shardq-1")
    assert call_tls_of(plain, trusts, cluster="main", namespace="shop") is None
    assert call_tls_of(stale, trusts, cluster="main", namespace="shop") == TlsSecretProblem("Secret old-tls is gone")
    assert isinstance(call_tls_of(unread, trusts, cluster="main", namespace="shop"), TlsSecretProblem)
    settings = client_tls_of(call)
    assert settings.root_certificates == CA_PEM
    assert settings.server_name == "main-shardq-1.main-shardq-peers.shop.svc.cluster.local"


def test_a_changed_ca_restarts_the_servers_and_a_renewed_certificate_does_not() -> None:
    cluster = cluster_with({"secretName": "main-tls"})

    def annotations(ca: bytes) -> dict[str, str]:
        trust = ServerTrust(ca_certificates=ca)
        built = builders.stateful_set(cluster, servers=3, credential=PEER, tls_trust=trust)["spec"]["template"]
        found: dict[str, str] = built["metadata"]["annotations"]
        return found

    old_ca = b"-----BEGIN CERTIFICATE-----\nold\n-----END CERTIFICATE-----\n"
    new_ca = b"-----BEGIN CERTIFICATE-----\nnew\n-----END CERTIFICATE-----\n"
    # The servers read ca.crt once: the template changes with it (the pods roll) ...
    assert annotations(old_ca)["shardq.io/tls-ca-digest"] != annotations(old_ca + new_ca)["shardq.io/tls-ca-digest"]
    # ... and only with it: the same CA, the same template, whatever certificate it signed.
    assert annotations(old_ca) == annotations(old_ca)
    assert "shardq.io/peer-secret-digest" in annotations(old_ca)
    # Plaintext clusters carry no digest of a CA.
    assert "shardq.io/tls-ca-digest" not in template(cluster_with(None))["metadata"].get("annotations", {})
