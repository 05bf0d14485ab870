"""A ShardqCluster's Ready condition names each server that is not ready and why, as its
pod says, the ones that will not get there by themselves first: a pod the scheduler
cannot place (an unbound volume) made the cluster read "0 of 3 servers ready,
ServersStarting" for good, with nothing saying what to fix.

A real API server (no scheduler, no kubelet): the pod's status is written through its
status subresource, as the scheduler writes it; the operator's own reconcile, run
in-process."""

from __future__ import annotations

import pytest
from kubernetes import client
from shardq_operator import naming
from shardq_operator.kube import Kube
from shardq_operator.reconciling import Reconciler

from e2e.crds import status_condition

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

UNBOUND = "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."


def test_the_cluster_names_the_servers_not_ready_and_why(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    body = {
        "apiVersion": naming.API_VERSION,
        "kind": "ShardqCluster",
        "metadata": {"name": "main"},
        "spec": {"servers": 3},
    }
    custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", body)
    # The pod the StatefulSet would make for server 1, left unplaced by the scheduler.
    stuck = naming.server_ids("main", 3)[1]
    pod = {
        "metadata": {"name": stuck, "labels": naming.selector("main")},
        "spec": {"containers": [{"name": "server", "image": "localhost/shardq:test"}]},
    }
    core.create_namespaced_pod(namespace, pod)
    unschedulable = {
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNBOUND}],
        }
    }
    core.patch_namespaced_pod_status(stuck, namespace, unschedulable)
    reconciler = Reconciler(Kube(api_client))
    try:
        reconciler.reconcile(namespace, "main")
        ready = status_condition(api_client, namespace, "shardqclusters", "main", "Ready")
    finally:
        reconciler.server_reads.stop()

    assert (ready["status"], ready["reason"]) == ("False", "ServersUnschedulable"), ready
    assert ready["message"].startswith(f"0 of 3 servers ready; {stuck}: not scheduled: {UNBOUND}"), ready["message"]
    for server in naming.server_ids("main", 3):
        assert f"{server}: " in ready["message"], ready["message"]
