"""The operator's one door to the Kubernetes API (kopf's own watches aside).

Objects are written with server-side apply (`fieldManager: shardq-operator`), so a
reconcile is idempotent and fields other managers own (kubectl edits of labels, HPA
replicas...) are left alone unless they conflict with ours, which we force.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from shardq.coordination.cluster_map import CLUSTER_MAP_KEY
from shardq.coordination.kubernetes_leases import KubernetesLeaseStore
from shardq_operator import naming

FIELD_MANAGER = "shardq-operator"
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_NOT_FOUND = 404
_TIMEOUT_S = 10.0

Manifest = dict[str, Any]


class ApplyRefused(Exception):
    """The API server refused an object the operator applies (or deletes, or reads); the message says why."""


def _api_message(error: ApiException) -> str:
    """The API server's own words for a refusal (its Status message), else the HTTP reason."""
    try:
        body = json.loads(error.body or "")
    except ValueError:
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return str(message) if message else f"{error.status} {error.reason}"


def _refusal(error: ApiException, what: str) -> ApplyRefused:
    """The API server's refusal of `what` (HTTP 4xx), in its own words; any other failure
    (a 5xx, no answer) is raised as it is, for the caller's retry."""
    if error.status is None or not 400 <= error.status < 500:
        raise error
    return ApplyRefused(f"{what}: {_api_message(error)}")


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    # -- writing ----------------------------------------------------------------
    def apply(self, manifest: Manifest) -> None:
        """Create or update `manifest` (server-side apply). ApplyRefused when the API server
        refuses the object itself (invalid, forbidden: HTTP 4xx), in its own words."""
        try:
            self._apply(manifest)
        except ApiException as error:
            raise _refusal(error, f"{manifest['kind']} {manifest['metadata']['name']}") from None

    def _apply(self, manifest: Manifest) -> None:
        kind = manifest["kind"]
        name = manifest["metadata"]["name"]
        options: dict[str, Any] = {
            "field_manager": FIELD_MANAGER,
            "force": True,
            "_content_type": _APPLY,
            "_request_timeout": _TIMEOUT_S,
        }
        if kind == "ClusterRoleBinding":  # the one cluster-scoped kind the operator writes
            self.rbac.patch_cluster_role_binding(name, manifest, **options)
            return
        namespace = manifest["metadata"]["namespace"]
        if kind == "Shard":
            self.custom.patch_namespaced_custom_object(
                naming.GROUP, naming.VERSION, namespace, "shards", name, manifest, **options
            )
            return
        writers: dict[str, Callable[..., Any]] = {
            "ServiceAccount": self.core.patch_namespaced_service_account,
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Secret": self.core.patch_namespaced_secret,
            "Service": self.core.patch_namespaced_service,
            "Role": self.rbac.patch_namespaced_role,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
            "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget,
            "StatefulSet": self.apps.patch_namespaced_stateful_set,
        }
        writers[kind](name, namespace, manifest, **options)

    def delete_cluster_role_binding(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Delete the ClusterRoleBinding `name` if it carries `labels` (it is the operator's:
        one of the same name made by someone else is left alone). False when there was
        nothing of ours to delete, a binding already gone included. ApplyRefused when the
        API server refuses the read or the delete (forbidden...), in its own words."""
        try:
            found = self.rbac.read_cluster_role_binding(name, _request_timeout=_TIMEOUT_S)
            metadata = found.metadata
            if metadata is None or any((metadata.labels or {}).get(key) != value for key, value in labels.items()):
                return False
            # The uid: a binding made anew since it was read is not deleted unread.
            self.rbac.delete_cluster_role_binding(
                name,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=metadata.uid)),
                _request_timeout=_TIMEOUT_S,
            )
        except ApiException as error:
            if error.status == _NOT_FOUND:
                return False
            raise _refusal(error, f"ClusterRoleBinding {name} (deleting it)") from None
        return True

    def patch_status(self, plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(
                naming.GROUP,
                naming.VERSION,
                namespace,
                plural,
                name,
                {"status": dict(status)},
                _content_type=_MERGE,
                _request_timeout=_TIMEOUT_S,
            )
        except ApiException as error:
            if error.status != _NOT_FOUND:  # deleted meanwhile: nothing to report on
                raise

    def event(self, involved: Mapping[str, Any], *, reason: str, message: str, warning: bool = False) -> None:
        """A core/v1 Event on `involved` (what `kubectl describe` shows)."""
        metadata = involved["metadata"]
        now = datetime.datetime.now(datetime.UTC)
        self.core.create_namespaced_event(
            metadata["namespace"],
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(generate_name=f"{metadata['name']}."),
                involved_object=client.V1ObjectReference(
                    api_version=involved.get("apiVersion", naming.API_VERSION),
                    kind=involved["kind"],
                    name=metadata["name"],
                    namespace=metadata["namespace"],
                    uid=metadata.get("uid"),
                ),
                reason=reason,
                message=message[:1024],
                type="Warning" if warning else "Normal",
                first_timestamp=now,
                last_timestamp=now,
                count=1,
                source=client.V1EventSource(component=FIELD_MANAGER),
            ),
            _request_timeout=_TIMEOUT_S,
        )

    # -- reading ----------------------------------------------------------------
    def get_custom(self, plural: str, namespace: str, name: str) -> Manifest | None:
        try:
            found: Manifest = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
                naming.GROUP, naming.VERSION, namespace, plural, name, _request_timeout=_TIMEOUT_S
            )
        except ApiException as error:
            if error.status == _NOT_FOUND:
                return None
            raise
        return found

    def list_custom(self, plural: str, namespace: str) -> list[Manifest]:
        listing: Manifest = self.custom.list_namespaced_custom_object(  # type: ignore[assignment]
            naming.GROUP, naming.VERSION, namespace, plural, _request_timeout=_TIMEOUT_S
        )
        items: list[Manifest] = listing.get("items", [])
        return items

    def read_map_text(self, namespace: str, cluster: str) -> str | None:
        try:
            config_map = self.core.read_namespaced_config_map(
                naming.map_config(cluster), namespace, _request_timeout=_TIMEOUT_S
            )
        except ApiException as error:
            if error.status == _NOT_FOUND:
                return None
            raise
        text: str | None = (config_map.data or {}).get(CLUSTER_MAP_KEY)
        return text

    def read_secret_data(self, namespace: str, name: str) -> Manifest | None:
        """The Secret `name` as {"data": {key: base64 text}}, or None when there is none.
        Read for a cluster's TLS CA (spec.tls), the only Secret the operator reads.
        ApplyRefused when the API server refuses the read (an operator without `get` on
        Secrets), in its own words."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace, _request_timeout=_TIMEOUT_S)
        except ApiException as error:
            if error.status == _NOT_FOUND:
                return None
            raise _refusal(error, f"Secret {name} (reading its {naming.TLS_CA_KEY})") from None
        return {"data": dict(secret.data or {})}

    def server_set_goes(self, namespace: str, cluster: str) -> bool:
        """Whether the cluster's StatefulSet is gone or being deleted (as in a namespace's
        deletion, which takes the servers' volumes with it)."""
        try:
            found = self.apps.read_namespaced_stateful_set(
                naming.server_set(cluster), namespace, _request_timeout=_TIMEOUT_S
            )
        except ApiException as error:
            if error.status == _NOT_FOUND:
                return True
            raise
        return found.metadata is not None and found.metadata.deletion_timestamp is not None

    def server_pods(self, namespace: str, cluster: str) -> list[Manifest]:
        selector = ",".join(f"{key}={value}" for key, value in naming.selector(cluster).items())
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=_TIMEOUT_S)
        as_dicts: list[Manifest] = [
            self.api_client.sanitize_for_serialization(pod)  # type: ignore[no-untyped-call]
            for pod in pods.items
        ]
        return as_dicts

    def own_lease(self, namespace: str, name: str, reference: Mapping[str, Any]) -> None:
        """Give a shard's Lease an owner `reference`, so the garbage collector removes it
        with its owner. Only the metadata is patched: the holder, epoch and ISR stay the
        servers' to change by compare-and-swap."""
        self.coordination.patch_namespaced_lease(
            name,
            namespace,
            {"metadata": {"ownerReferences": [dict(reference)]}},
            _content_type=_MERGE,
            _request_timeout=_TIMEOUT_S,
        )

    def leases(self, namespace: str) -> KubernetesLeaseStore:
        """The shard leases of `namespace`, read with requests (the operator reads them once a tick)."""
        return KubernetesLeaseStore(self.api_client, namespace=namespace, watch=False)
