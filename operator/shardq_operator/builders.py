"""Manifests of what a ShardqCluster and its Queues become (pure: dicts in, dicts out).

Every builder takes the owner's metadata and returns a complete object carrying an
owner reference, so deleting the owner lets the garbage collector remove it; all but
the one cluster-scoped object (`auth_delegator_binding`), which the operator removes
itself.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from shardq.coordination.cluster_map import CLUSTER_MAP_KEY, ClusterMap, cluster_map_to_text
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq_operator import naming
from shardq_operator.client_authentication import client_authentication, server_args
from shardq_operator.peer_secrets import secret_digest
from shardq_operator.transport_security import TLS_VOLUME, ServerTrust, ca_digest, server_tls_args, tls_secret_name

Manifest = dict[str, Any]


def lease_owner_reference(cluster: Mapping[str, Any]) -> Manifest:
    """The reference a shard's Lease carries to its ShardqCluster: deleted with it, but
    not controlled by it (the servers write the Lease) and not holding its deletion up."""
    return {**owner_reference(cluster), "controller": False, "blockOwnerDeletion": False}


def owner_reference(owner: Mapping[str, Any]) -> Manifest:
    """A controller reference to `owner` (a ShardqCluster or Queue as read from the API)."""
    metadata = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", naming.API_VERSION),
        "kind": owner["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, owner: Mapping[str, Any], cluster: str) -> Manifest:
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": naming.labels(cluster),
        "ownerReferences": [owner_reference(owner)],
    }


def service_account(owner: Mapping[str, Any]) -> Manifest:
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(naming.account(cluster), owner, cluster),
    }


def role(owner: Mapping[str, Any]) -> Manifest:
    """The servers' rights: their shard Leases (read, watch, renew) and their map's ConfigMap (read)."""
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(naming.account(cluster), owner, cluster),
        "rules": [
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "verbs": ["get", "list", "watch", "update", "patch"],
            },
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [naming.map_config(cluster)],
                "verbs": ["get", "watch"],
            },
        ],
    }


def role_binding(owner: Mapping[str, Any]) -> Manifest:
    cluster = owner["metadata"]["name"]
    name = naming.account(cluster)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(name, owner, cluster),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner["metadata"]["namespace"]}],
    }


def auth_delegator_binding(owner: Mapping[str, Any]) -> Manifest:
    """The servers' ServiceAccount bound to the built-in ClusterRole system:auth-delegator,
    so that they may have their clients' tokens reviewed (TokenReview) and calls authorised
    (SubjectAccessReview): for `spec.clientAuthentication.mode: kubernetes` only.

    No owner reference: a cluster-scoped object cannot be owned by a namespaced one (the
    garbage collector would never remove it). The operator deletes it itself, finding it
    by name and checking it by its labels (kube.delete_cluster_role_binding)."""
    cluster = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {
            "name": naming.auth_delegator_binding(namespace, cluster),
            "labels": naming.cluster_scoped_labels(namespace, cluster),
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": naming.AUTH_DELEGATOR},
        "subjects": [{"kind": "ServiceAccount", "name": naming.account(cluster), "namespace": namespace}],
    }


def map_config(owner: Mapping[str, Any], cluster_map: ClusterMap) -> Manifest:
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(naming.map_config(cluster), owner, cluster),
        "data": {CLUSTER_MAP_KEY: cluster_map_to_text(cluster_map)},
    }


def peer_secret(owner: Mapping[str, Any], credential: PeerCredential) -> Manifest:
    """What the cluster's servers present to each other (shardq.coordination.peer_credentials)."""
    cluster = owner["metadata"]["name"]
    assert credential.secret is not None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(naming.peer_secret(cluster), owner, cluster),
        "type": "Opaque",
        "data": {naming.PEER_SECRET_KEY: base64.b64encode(credential.secret.encode()).decode()},
    }


def peers_service(owner: Mapping[str, Any]) -> Manifest:
    """Headless: every server a stable DNS name, published before it is ready (peers
    must reach a starting follower to bring it up to date)."""
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(naming.peers_service(cluster), owner, cluster),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": naming.selector(cluster),
            "ports": [{"name": "grpc", "port": naming.GRPC_PORT, "targetPort": "grpc"}],
        },
    }


def client_service(owner: Mapping[str, Any]) -> Manifest:
    """What clients connect to: any ready server answers (and forwards to shard leaders)."""
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(naming.client_service(cluster), owner, cluster),
        "spec": {
            "selector": naming.selector(cluster),
            "ports": [
                {"name": "grpc", "port": naming.GRPC_PORT, "targetPort": "grpc"},
                {"name": "metrics", "port": naming.METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def disruption_budget(owner: Mapping[str, Any]) -> Manifest:
    """One server down at a time for voluntary disruptions (drains): a shard with three
    replicas keeps a majority of its copies."""
    cluster = owner["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(naming.server_set(cluster), owner, cluster),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": naming.selector(cluster)}},
    }


def stateful_set(
    owner: Mapping[str, Any],
    *,
    servers: int,
    credential: PeerCredential = NO_PEER_SECRET,
    tls_trust: ServerTrust | None = None,
) -> Manifest:
    """The shard servers: one pod per server id, a volume each, Ready when gRPC health says
    so, and the cluster's peer secret (`credential`, none when the operator has no key).
    With spec.tls, they serve TLS from its Secret (transport_security), whose CA the
    operator read (`tls_trust`); without it the template is what it was before TLS
    existed, so an operator upgrade restarts no pod."""
    cluster = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    spec = owner.get("spec", {})
    storage = spec.get("storage", {})
    template_overrides = spec.get("podTemplate", {})
    container: Manifest = {
        "name": "server",
        "image": spec.get("image", "localhost/shardq:latest"),
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        # `args`, not `command`: the image's entrypoint (tini) stays PID 1 and reaps.
        "args": [
            "shardq",
            "serve",
            "--data-dir",
            naming.DATA_PATH,
            "--host",
            "0.0.0.0",
            "--port",
            str(naming.GRPC_PORT),
            "--metrics-port",
            str(naming.METRICS_PORT),
            "--server-id",
            "$(POD_NAME)",
            "--lease-store",
            "kubernetes",
            "--namespace",
            "$(POD_NAMESPACE)",
            "--cluster-configmap",
            naming.map_config(cluster),
            "--queues-managed-by",
            f"the Queue resources of namespace {namespace} (kubectl apply)",
            "--log-format",
            "text",
            # Clients' rights are asked for on the Queues of `--namespace` (client_authentication.py).
            *server_args(client_authentication(owner)),
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": naming.GRPC_PORT},
            {"name": "metrics", "containerPort": naming.METRICS_PORT},
        ],
        "readinessProbe": {"grpc": {"port": naming.GRPC_PORT}, "periodSeconds": 1, "failureThreshold": 3},
        "volumeMounts": [{"name": "data", "mountPath": naming.DATA_PATH}],
    }
    if spec.get("resources"):
        container["resources"] = spec["resources"]
    pod_spec: Manifest = {
        "serviceAccountName": naming.account(cluster),
        "containers": [container],
        "terminationGracePeriodSeconds": 15,
    }
    template_metadata: Manifest = {"labels": naming.labels(cluster)}
    if credential.secret is not None:
        container["args"] += ["--peer-secret-file", f"{naming.PEER_SECRET_PATH}/{naming.PEER_SECRET_KEY}"]
        container["volumeMounts"].append(
            {"name": "peer-secret", "mountPath": naming.PEER_SECRET_PATH, "readOnly": True}
        )
        pod_spec["volumes"] = [
            {"name": "peer-secret", "secret": {"secretName": naming.peer_secret(cluster), "defaultMode": 0o400}}
        ]
        # A server reads its secret once, at start: a changed one must restart every pod.
        template_metadata["annotations"] = {"shardq.io/peer-secret-digest": secret_digest(credential)}
    tls_secret = tls_secret_name(owner)
    if tls_secret is not None:
        container["args"] += server_tls_args()
        container["ports"].append({"name": "health", "containerPort": naming.HEALTH_PORT})
        # The kubelet's gRPC probe speaks no TLS: it asks the plaintext health-only port.
        container["readinessProbe"]["grpc"] = {"port": naming.HEALTH_PORT}
        container["volumeMounts"].append({"name": TLS_VOLUME, "mountPath": naming.TLS_PATH, "readOnly": True})
        # Not a subPath: the kubelet updates a mounted Secret in place (a renewed
        # certificate), and the servers re-read the files for new connections.
        pod_spec.setdefault("volumes", []).append(
            {"name": TLS_VOLUME, "secret": {"secretName": tls_secret, "defaultMode": 0o400}}
        )
        if tls_trust is not None:
            # A server reads the CA it checks its peers against once, at start (its peers'
            # channels live as long as it does): a changed ca.crt, as a CA rotation first
            # adds the new CA and later drops the old, restarts the pods one at a time. A
            # renewed certificate from the same CA restarts nothing.
            template_metadata.setdefault("annotations", {})["shardq.io/tls-ca-digest"] = ca_digest(tls_trust)
    for field in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName"):
        if field in template_overrides:
            pod_spec[field] = template_overrides[field]
    claim_spec: Manifest = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": storage.get("size", "1Gi")}},
    }
    if storage.get("storageClassName"):
        claim_spec["storageClassName"] = storage["storageClassName"]
    retain = storage.get("retainOnDelete", True)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(naming.server_set(cluster), owner, cluster),
        "spec": {
            "serviceName": naming.peers_service(cluster),
            "replicas": servers,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": naming.selector(cluster)},
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Retain" if retain else "Delete",
                "whenScaled": "Retain",
            },
            "template": {"metadata": template_metadata, "spec": pod_spec},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": claim_spec}],
        },
    }


def shard(owner: Mapping[str, Any], *, index: int, replicas: list[str]) -> Manifest:
    """One Shard object of a Queue (`owner`)."""
    queue = owner["metadata"]["name"]
    cluster = owner.get("spec", {}).get("cluster", naming.DEFAULT_CLUSTER)
    metadata = _metadata(naming.shard_object(queue, index), owner, cluster)
    metadata["labels"] = {**metadata["labels"], "shardq.io/queue": queue}
    return {
        "apiVersion": naming.API_VERSION,
        "kind": "Shard",
        "metadata": metadata,
        "spec": {"queue": queue, "index": index, "replicas": replicas},
    }
