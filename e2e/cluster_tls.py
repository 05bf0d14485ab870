"""A ShardqCluster's TLS Secret, made as cert-manager would make it, for tests on a real
API server: a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt, whose
certificate carries the names the cluster's servers are called by (the README's "TLS");
and what a client pod of such a cluster mounts."""

from __future__ import annotations

import base64
import datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from shardq_operator import naming

from e2e.certificates import ServingCertificates, issue_serving_certificates, renew_serving_certificate
from shardq.bearer_tokens import TOKEN_FILE_ENV
from shardq.tls import CA_FILE_ENV


def client_service_name(cluster: str, namespace: str) -> str:
    """The name a client that reaches the client Service by its IP checks the certificate for."""
    return f"{naming.client_service(cluster)}.{namespace}.svc.cluster.local"


def server_names(cluster: str, namespace: str) -> list[str]:
    """Each server by its peers' Service, and the client Service."""
    return [f"*.{naming.peers_service(cluster)}.{namespace}.svc.cluster.local", client_service_name(cluster, namespace)]


def _encoded(files: dict[str, Path]) -> dict[str, str]:
    return {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()}


def make_cluster_tls_secret(
    api: client.ApiClient, namespace: str, *, cluster: str, secret: str, directory: Path
) -> ServingCertificates:
    """The Secret `secret` that `cluster` serves TLS with, its files also written to
    `directory` (ServingCertificates.ca is the CA certificate clients trust)."""
    names = server_names(cluster, namespace)
    return make_tls_secret(api, namespace, secret=secret, directory=directory, dns_names=names)


def make_tls_secret(
    api: client.ApiClient, namespace: str, *, secret: str, directory: Path, dns_names: list[str]
) -> ServingCertificates:
    """A kubernetes.io/tls Secret `secret` for `dns_names`, under a CA of its own, its
    files also written to `directory`."""
    certificates = issue_serving_certificates(directory, dns_names=dns_names)
    client.CoreV1Api(api).create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=secret),
            type="kubernetes.io/tls",
            data=_encoded({"tls.crt": certificates.cert, "tls.key": certificates.key, "ca.crt": certificates.ca}),
        ),
    )
    return certificates


def renew_cluster_tls_secret(
    api: client.ApiClient,
    namespace: str,
    *,
    cluster: str,
    secret: str,
    issued: ServingCertificates,
    validity: datetime.timedelta,
) -> ServingCertificates:
    """What a cert-manager renewal does to the Secret: a new key and certificate from the
    same CA written in place (ca.crt unchanged)."""
    renewed = renew_serving_certificate(
        issued, dns_names=server_names(cluster, namespace), stem="renewed", validity=validity
    )
    client.CoreV1Api(api).patch_namespaced_secret(
        secret, namespace, {"data": _encoded({"tls.crt": renewed.cert, "tls.key": renewed.key})}
    )
    return renewed


# Where a client pod is shown shardq's credentials: a token for shardq's audience and the
# CA that signed the cluster's certificate (ca.crt alone, never the servers' key), in one
# projected volume, and the variables every shardq client in the pod reads.
CREDENTIALS_MOUNT = "/var/run/secrets/shardq"
TOKEN_SECONDS = 3600


def credentials_volume(
    name: str, *, audience: str, ca_secret: str | None = None, ca_config_map: str | None = None
) -> dict[str, Any]:
    """The projected volume (as the API takes it) with the pod's token and the CA: the
    cluster's TLS Secret's ca.crt (`ca_secret`, for pods in the cluster's namespace), or
    a ConfigMap's (`ca_config_map`: a pod elsewhere cannot mount the Secret; a CA
    certificate is no secret, so it is copied, or trust-manager distributes it)."""
    if (ca_secret is None) == (ca_config_map is None):
        raise ValueError("give the CA's Secret or its ConfigMap")
    source = "secret" if ca_secret is not None else "configMap"
    return {
        "name": name,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"audience": audience, "expirationSeconds": TOKEN_SECONDS, "path": "token"}},
                {source: {"name": ca_secret or ca_config_map, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            ]
        },
    }


def credentials_environment() -> dict[str, str]:
    """What the shardq clients in a pod with credentials_volume at CREDENTIALS_MOUNT read."""
    return {
        TOKEN_FILE_ENV: f"{CREDENTIALS_MOUNT}/token",
        CA_FILE_ENV: f"{CREDENTIALS_MOUNT}/ca.crt",
    }
