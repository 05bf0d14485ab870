"""Installing shardq's CRDs (`crds/`) on a test cluster, as `kubectl apply -f crds/` would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.polling import wait_for

CRDS_DIR = Path(__file__).resolve().parent.parent / "crds"
_CONFLICT = 409


def crd_manifests() -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text()) for path in sorted(CRDS_DIR.glob("*.yaml"))]


def install_crds(api: client.ApiClient) -> list[str]:
    """Create (or replace) every CRD and wait until each is Established; their names."""
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for manifest in crd_manifests():
        name = manifest["metadata"]["name"]
        names.append(name)
        try:
            extensions.create_custom_resource_definition(manifest)
        except ApiException as error:
            if error.status != _CONFLICT:
                raise
            current = extensions.read_custom_resource_definition(name)
            manifest["metadata"]["resourceVersion"] = current.metadata.resource_version
            extensions.replace_custom_resource_definition(name, manifest)

    def established() -> bool:
        for name in names:
            crd = extensions.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in (crd.status.conditions or [])} if crd.status else {}
            if conditions.get("Established") != "True":
                return False
        return True

    wait_for(established, timeout=60, what="the shardq CRDs to be established")
    return names


SHARDQ_PLURALS = ("queues", "shardqclusters", "shards")


def release_finalizers(api: client.ApiClient, namespace: str) -> int:
    """Remove the operator's finalizers from the shardq objects left in `namespace`, as a
    user does whose operator is gone (a test's operator stops before its namespace is
    deleted): otherwise the namespace stays Terminating for good. Returns how many."""
    custom = client.CustomObjectsApi(api)
    released = 0
    for plural in SHARDQ_PLURALS:
        try:
            items = custom.list_namespaced_custom_object("shardq.io", "v1alpha1", namespace, plural)["items"]
        except ApiException as error:
            if error.status == 404:
                continue  # the CRDs are not installed
            raise
        for item in items:
            if not item["metadata"].get("finalizers"):
                continue
            try:
                custom.patch_namespaced_custom_object(
                    "shardq.io", "v1alpha1", namespace, plural, item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )  # fmt: skip
                released += 1
            except ApiException as error:
                if error.status != 404:
                    raise
    return released


def status_condition(api: client.ApiClient, namespace: str, plural: str, name: str, kind: str) -> dict[str, Any]:
    """The condition of type `kind` in a shardq object's status (exactly one)."""
    found = client.CustomObjectsApi(api).get_namespaced_custom_object("shardq.io", "v1alpha1", namespace, plural, name)
    (condition,) = [c for c in found["status"]["conditions"] if c["type"] == kind]
    return dict(condition)
