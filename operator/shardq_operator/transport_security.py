"""TLS as a ShardqCluster asks for it (pure): the servers' flags, whether the cluster's
Secret can serve, and how the operator's own calls reach each server.

With `spec.tls.secretName` the servers serve TLS on their gRPC and metrics ports with the
Secret's `tls.crt` and `tls.key` (a `kubernetes.io/tls` Secret, as cert-manager writes
it), check each other against its `ca.crt`, and answer the kubelet's probe on a plaintext
health-only port (the kubelet's gRPC probe cannot speak TLS). The operator does not mount
the Secret: it reads `ca.crt` through the API and checks each server's certificate
against it, for the name the server's peers call it by (the operator calls pods by IP).

A pod serves TLS or not by its own spec (its arguments are fixed for its life), not by
the cluster's: while the StatefulSet rolls from one to the other, the operator calls each
pod as it serves.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from shardq_operator import naming

TLS_VOLUME = "tls"
CERT_FILE_FLAG = "--tls-cert-file"
PEM_CERTIFICATE_MARKER = b"-----BEGIN CERTIFICATE-----"
REQUIRED_KEYS = (naming.TLS_CERT_KEY, naming.TLS_KEY_KEY, naming.TLS_CA_KEY)


@dataclasses.dataclass(frozen=True)
class ServerTrust:
    """What the operator trusts a TLS cluster's servers by: the CA certificates (PEM) of
    the cluster's Secret."""

    ca_certificates: bytes


@dataclasses.dataclass(frozen=True)
class TlsSecretProblem:
    """Why a cluster's TLS Secret cannot serve (named, with the key at fault)."""

    message: str


@dataclasses.dataclass(frozen=True)
class CallTls:
    """How the operator's calls to one server speak TLS: the CA to check its certificate
    against, and the name to check it for."""

    ca_certificates: bytes
    server_name: str


def ca_digest(trust: ServerTrust) -> str:
    """What the server pods' template carries so that a changed ca.crt rolls them."""
    return hashlib.sha256(trust.ca_certificates).hexdigest()[:16]


def tls_secret_name(cluster: Mapping[str, Any]) -> str | None:
    """The Secret `spec.tls.secretName` names, or None: the cluster serves plaintext."""
    setting = cluster.get("spec", {}).get("tls") or {}
    name = setting.get("secretName")
    return str(name) if name else None


def server_tls_args() -> list[str]:
    """The `shardq serve` flags of a server serving TLS from the Secret mounted at naming.TLS_PATH."""
    return [
        CERT_FILE_FLAG,
        f"{naming.TLS_PATH}/{naming.TLS_CERT_KEY}",
        "--tls-key-file",
        f"{naming.TLS_PATH}/{naming.TLS_KEY_KEY}",
        "--tls-ca-file",
        f"{naming.TLS_PATH}/{naming.TLS_CA_KEY}",
        "--health-port",
        str(naming.HEALTH_PORT),
    ]


def check_tls_secret(name: str, namespace: str, secret: Mapping[str, Any] | None) -> ServerTrust | TlsSecretProblem:
    """Whether the Secret `name` (as read from the API, None when there is none) can serve
    TLS: it holds tls.crt, tls.key and ca.crt, and ca.crt holds a PEM certificate. Servers
    could not start without the keys (the kubelet leaves a pod whose Secret is missing
    without containers, a server whose file is missing exits), and the operator could not
    check them without the CA."""
    where = f"Secret {name} (spec.tls.secretName) in namespace {namespace}"
    if secret is None:
        return TlsSecretProblem(
            f"{where} does not exist: make it (kubernetes.io/tls, with {', '.join(REQUIRED_KEYS)}), "
            "e.g. with a cert-manager Certificate"
        )
    data = secret.get("data") or {}
    missing = [key for key in REQUIRED_KEYS if not data.get(key)]
    if missing:
        return TlsSecretProblem(f"{where} has no {', '.join(missing)} (it needs {', '.join(REQUIRED_KEYS)})")
    try:
        ca = base64.b64decode(str(data[naming.TLS_CA_KEY]), validate=True)
    except (binascii.Error, ValueError):
        return TlsSecretProblem(f"{where}: its {naming.TLS_CA_KEY} is not base64")
    if PEM_CERTIFICATE_MARKER not in ca:
        return TlsSecretProblem(f"{where}: its {naming.TLS_CA_KEY} holds no PEM certificate")
    return ServerTrust(ca_certificates=ca)


def serving_tls_secret(pod: Mapping[str, Any]) -> str | None:
    """The Secret a pod's server serves TLS from (by the pod's spec), or None: plaintext."""
    spec = pod.get("spec", {})
    for container in spec.get("containers") or []:
        if container.get("name") == "server" and CERT_FILE_FLAG in (container.get("args") or []):
            break
    else:
        return None
    for volume in spec.get("volumes") or []:
        if volume.get("name") == TLS_VOLUME:
            return str((volume.get("secret") or {}).get("secretName") or "") or None
    return None


def call_tls_of(
    pod: Mapping[str, Any],
    trusts: Mapping[str, ServerTrust | TlsSecretProblem],
    *,
    cluster: str,
    namespace: str,
) -> CallTls | TlsSecretProblem | None:
    """How the operator calls a pod's server: plaintext (None) when it serves plaintext;
    else TLS checked against the CA of the Secret it serves from (`trusts`, by Secret
    name) for its peers' name of it; or why it cannot be called (that Secret's problem)."""
    secret = serving_tls_secret(pod)
    if secret is None:
        return None
    trust = trusts.get(secret) or TlsSecretProblem(f"Secret {secret} in namespace {namespace} was not read")
    if isinstance(trust, TlsSecretProblem):
        return trust
    server_id = str(pod.get("metadata", {}).get("name", ""))
    return CallTls(ca_certificates=trust.ca_certificates, server_name=naming.server_host(cluster, namespace, server_id))
