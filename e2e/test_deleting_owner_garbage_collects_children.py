"""The garbage collector of the real kube-controller-manager deletes dependents of a
deleted owner: a ConfigMap owned by a ConfigMap (background propagation) and a
Deployment's ReplicaSet and Pods (foreground propagation)."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.polling import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]


def test_background_deletion_removes_owned_configmap(api_client: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner")))
    assert owner.metadata is not None
    assert owner.metadata.uid
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(
                name="child",
                owner_references=[
                    client.V1OwnerReference(
                        api_version="v1",
                        kind="ConfigMap",
                        name="owner",
                        uid=owner.metadata.uid,
                    )
                ],
            ),
            data={"k": "v"},
        ),
    )
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bystander")))

    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def child_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", namespace)
        except ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    wait_for(child_gone, timeout=60, what="configmap child garbage-collected", interval=0.25)
    names = {cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items if cm.metadata}
    assert "bystander" in names
    assert "owner" not in names


def build_deployment(name: str) -> client.V1Deployment:
    labels = {"app": name}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="main", image="shardq:e2e")]),
            ),
        ),
    )


def test_foreground_deletion_of_deployment_removes_replicaset_and_pods(
    api_client: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api_client)
    apps = client.AppsV1Api(api_client)
    apps.create_namespaced_deployment(namespace, build_deployment("web"))

    def pods() -> list[client.V1Pod]:
        return core.list_namespaced_pod(namespace, label_selector="app=web").items

    # The deployment controller creates a ReplicaSet, whose controller creates the pods.
    wait_for(lambda: len(pods()) == 2, timeout=60, what="2 pods of deployment web")
    (replica_set,) = apps.list_namespaced_replica_set(namespace, label_selector="app=web").items
    assert replica_set.metadata is not None
    assert replica_set.metadata.owner_references
    assert replica_set.metadata.owner_references[0].kind == "Deployment"

    apps.delete_namespaced_deployment("web", namespace, propagation_policy="Foreground")

    def all_gone() -> bool:
        replica_sets = apps.list_namespaced_replica_set(namespace, label_selector="app=web")
        deployments = apps.list_namespaced_deployment(namespace)
        return not pods() and not replica_sets.items and not deployments.items

    wait_for(
        all_gone,
        timeout=60,
        what="deployment, replicaset and pods deleted",
        interval=0.25,
    )
