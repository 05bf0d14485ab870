"""The StatefulSet controller of the real kube-controller-manager creates the pods, in
order, once the fake kubelet reports each predecessor Ready."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.fakekubelet import delete_pod_now, mark_pod_ready
from e2e.polling import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]


def build_statefulset(name: str, replicas: int) -> client.V1StatefulSet:
    labels = {"app": name}
    return client.V1StatefulSet(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1StatefulSetSpec(
            replicas=replicas,
            service_name=name,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="shard", image="shardq:e2e")]),
            ),
        ),
    )


def read_pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def test_statefulset_pods_are_created_in_order_and_recreated(api_client: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api_client)
    apps = client.AppsV1Api(api_client)
    apps.create_namespaced_stateful_set(namespace, build_statefulset("shard", replicas=2))

    pod0 = wait_for(
        lambda: read_pod(core, namespace, "shard-0"),
        timeout=30,
        what="pod shard-0 created",
    )
    assert pod0.metadata is not None
    assert pod0.metadata.owner_references
    assert pod0.metadata.owner_references[0].kind == "StatefulSet"
    # OrderedReady: no shard-1 while shard-0 is not Ready.
    assert read_pod(core, namespace, "shard-1") is None

    ready0 = mark_pod_ready(api_client, namespace=namespace, name="shard-0")
    assert ready0.status is not None
    assert ready0.status.phase == "Running"
    assert ready0.spec is not None
    assert ready0.spec.node_name == "node-1"

    wait_for(
        lambda: read_pod(core, namespace, "shard-1"),
        timeout=30,
        what="pod shard-1 created",
    )
    mark_pod_ready(api_client, namespace=namespace, name="shard-1")

    def ready_replicas() -> int | None:
        status = apps.read_namespaced_stateful_set(name="shard", namespace=namespace).status
        return status.ready_replicas if status and status.ready_replicas == 2 else None

    wait_for(ready_replicas, timeout=30, what="statefulset shard readyReplicas == 2")

    # A pod that dies is recreated under the same name, as a new pod.
    old_uid = ready0.metadata.uid if ready0.metadata else None
    delete_pod_now(api_client, namespace=namespace, name="shard-0")

    def recreated() -> client.V1Pod | None:
        pod = read_pod(core, namespace, "shard-0")
        return pod if pod and pod.metadata and pod.metadata.uid != old_uid else None

    replacement = wait_for(recreated, timeout=30, what="pod shard-0 recreated")
    assert replacement.status is not None
    assert replacement.status.phase == "Pending"
