"""Names, labels and addresses of everything the operator makes for a ShardqCluster."""

from __future__ import annotations

import hashlib

GROUP = "shardq.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
GRPC_PORT = 7600
METRICS_PORT = 9600
# Plaintext gRPC health only, for the kubelet's probe, which cannot speak TLS (`--health-port`):
# served by the servers of a cluster with spec.tls.
HEALTH_PORT = 7602
DATA_PATH = "/data"
# Where a server pod finds its cluster's peer secret (a Secret volume), under this key.
PEER_SECRET_PATH = "/etc/shardq/peer"
PEER_SECRET_KEY = "secret"
# Where a server pod of a cluster with spec.tls finds its certificate, key and CA: the
# Secret spec.tls.secretName names, keyed as cert-manager and `kubernetes.io/tls` key it.
TLS_PATH = "/etc/shardq/tls"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"
TLS_CA_KEY = "ca.crt"
MANAGED_BY = "shardq-operator"
# A Queue that names no cluster is placed on this one (the chart can create it).
DEFAULT_CLUSTER = "default"
# The built-in ClusterRole allowing TokenReviews and SubjectAccessReviews: what servers
# that authenticate their clients need (client_authentication.py).
AUTH_DELEGATOR = "system:auth-delegator"
# On the operator's cluster-scoped objects, which carry no namespace of their own.
NAMESPACE_LABEL = "shardq.io/namespace"
# The longest name most kinds take (a DNS subdomain's); kept to for RBAC objects too.
MAX_NAME_CHARS = 253


def server_set(cluster: str) -> str:
    """The StatefulSet, and the prefix of its pods' names (which are the servers' ids)."""
    return f"{cluster}-shardq"


def peers_service(cluster: str) -> str:
    return f"{cluster}-shardq-peers"


def client_service(cluster: str) -> str:
    return f"{cluster}-shardq"


def map_config(cluster: str) -> str:
    return f"{cluster}-shardq-map"


def peer_secret(cluster: str) -> str:
    return f"{cluster}-shardq-peer"


def account(cluster: str) -> str:
    return f"{cluster}-shardq"


def auth_delegator_binding(namespace: str, cluster: str) -> str:
    """The ClusterRoleBinding of a cluster's servers to system:auth-delegator. Cluster-scoped,
    so the namespace is in its name; a ':' is in neither a namespace's name nor a
    ShardqCluster's, so no two clusters share one. A name too long is cut and given a
    digest of the whole (no whole name ends in one)."""
    name = f"shardq:{namespace}:{cluster}:auth-delegator"
    if len(name) <= MAX_NAME_CHARS:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{name[: MAX_NAME_CHARS - len(digest) - 1]}-{digest}"


def server_ids(cluster: str, count: int) -> list[str]:
    return [f"{server_set(cluster)}-{ordinal}" for ordinal in range(count)]


def server_host(cluster: str, namespace: str, server_id: str) -> str:
    """A server's stable DNS name through the headless Service: the name its peers call it
    by, so the one its TLS certificate must carry."""
    return f"{server_id}.{peers_service(cluster)}.{namespace}.svc.cluster.local"


def server_address(cluster: str, namespace: str, server_id: str) -> str:
    """A server's stable DNS name through the headless Service, with its gRPC port."""
    return f"{server_host(cluster, namespace, server_id)}:{GRPC_PORT}"


def client_endpoint(cluster: str, namespace: str) -> str:
    return f"{client_service(cluster)}.{namespace}.svc.cluster.local:{GRPC_PORT}"


def shard_object(queue: str, index: int) -> str:
    return f"{queue}-{index}"


def labels(cluster: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "shardq-server",
        "app.kubernetes.io/instance": cluster,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def cluster_scoped_labels(namespace: str, cluster: str) -> dict[str, str]:
    """`labels`, and the cluster's namespace: what finds a cluster's cluster-scoped objects
    (`kubectl get clusterrolebindings -l shardq.io/namespace=NS,app.kubernetes.io/instance=NAME`)."""
    return {**labels(cluster), NAMESPACE_LABEL: namespace}


def selector(cluster: str) -> dict[str, str]:
    """What selects a cluster's server pods (a subset of `labels`, fixed for the set's life)."""
    return {"app.kubernetes.io/name": "shardq-server", "app.kubernetes.io/instance": cluster}
