"""The kubelet's part, played through the API as Kubernetes' own integration tests do:
register a Node, bind pods to it, report them Running and Ready, delete them at once.

Nothing runs in a pod. A test that needs a process behind a pod starts it itself (on
127.0.0.1) and reports its address as the pod IP. A Service selecting such pods gets no
EndpointSlice for them: endpoint validation rejects loopback addresses.
"""

from __future__ import annotations

import datetime
from typing import cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.polling import wait_for

NODE_NAME = "node-1"
_MERGE_PATCH = "application/merge-patch+json"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ensure_node(api: client.ApiClient, *, name: str = NODE_NAME) -> None:
    """Register a Ready node named `name` if there is none (idempotent)."""
    core = client.CoreV1Api(api)
    node = client.V1Node(
        metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name}),
        status=client.V1NodeStatus(
            capacity={"cpu": "64", "memory": "256Gi", "pods": "500"},
            allocatable={"cpu": "64", "memory": "256Gi", "pods": "500"},
            conditions=[
                client.V1NodeCondition(
                    type="Ready",
                    status="True",
                    reason="KubeletReady",
                    message="played by e2e.fakekubelet",
                )
            ],
            addresses=[client.V1NodeAddress(type="Hostname", address=name)],
        ),
    )
    try:
        core.create_node(node)
    except ApiException as error:
        if error.status != 409:
            raise


def bind_pod(api: client.ApiClient, *, namespace: str, name: str, node: str = NODE_NAME) -> None:
    """Do the scheduler's job: bind a pending pod to `node` (the binding subresource)."""
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name=name),
        target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    # The server answers a binding with a Status, not a Binding, which the generated
    # client cannot decode into its return type; take the raw response instead (it
    # still raises ApiException for an error status).
    response = cast(
        urllib3.BaseHTTPResponse,
        client.CoreV1Api(api).create_namespaced_pod_binding(name, namespace, binding, _preload_content=False),
    )
    response.read()
    response.release_conn()


def mark_pod_ready(
    api: client.ApiClient,
    *,
    namespace: str,
    name: str,
    pod_ip: str = "127.0.0.1",
    node: str = NODE_NAME,
) -> client.V1Pod:
    """Report a pod Running and Ready, as a kubelet would once its containers started.

    Binds the pod to `node` first (registering the node) if it is not bound yet. Patches
    the status subresource: phase Running, conditions PodScheduled, Initialized,
    ContainersReady and Ready all True, pod and host IP, one running and ready status per
    container. Returns the updated pod.
    """
    core = client.CoreV1Api(api)
    pod = core.read_namespaced_pod(name, namespace)
    if pod.spec is None:
        raise ValueError(f"pod {namespace}/{name} has no spec")
    if not pod.spec.node_name:
        ensure_node(api, name=node)
        bind_pod(api, namespace=namespace, name=name, node=node)
    now = _now()
    status = {
        "phase": "Running",
        "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ],
        "hostIP": pod_ip,
        "hostIPs": [{"ip": pod_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": now,
        "containerStatuses": [
            {
                "name": container.name,
                "image": container.image or "",
                "imageID": "",
                "containerID": f"fake://{namespace}/{name}/{container.name}",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for container in pod.spec.containers
        ],
    }
    # A merge patch replaces the lists whole, so the result does not depend on what
    # the status held before.
    return core.patch_namespaced_pod_status(name, namespace, {"status": status}, _content_type=_MERGE_PATCH)


def delete_pod_now(api: client.ApiClient, *, namespace: str, name: str, timeout: float = 30.0) -> None:
    """Delete a pod with grace period 0 (no kubelet will confirm it) and wait until it is gone.

    A controller may recreate a pod of the same name at once (a StatefulSet does), so
    "gone" means this pod, by UID.
    """
    core = client.CoreV1Api(api)

    def current_uid() -> str | None:
        try:
            pod = core.read_namespaced_pod(name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return pod.metadata.uid if pod.metadata else None

    uid = current_uid()
    if uid is None:
        return
    try:
        core.delete_namespaced_pod(
            name,
            namespace,
            grace_period_seconds=0,
            body=client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)),
        )
    except ApiException as error:
        # 404: already gone; 409: the precondition failed, so a new pod holds the name.
        if error.status not in (404, 409):
            raise
    wait_for(
        lambda: current_uid() != uid,
        timeout=timeout,
        what=f"pod {namespace}/{name} (uid {uid}) to be deleted",
    )
