"""One object the API server refuses does not stop the operator's pass over a cluster.

A StatefulSet whose volume claims differ from the operator's (one made by hand before
the cluster, or a storage edit from before the CRD refused them) cannot be changed by
any apply: the API server forbids it. The pass raised there, before its failover
decisions, and kopf's timer then waited a minute before trying again, while shards
whose leader had died stayed unled (seen on the real node). Now the pass goes on: the
map, the leases and the Shard objects are written, and a Warning Event on the
ShardqCluster says what was refused and why.

A real API server (the control plane, no pods); the reconcile is the operator's own,
run in-process on the admin's client."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from shardq_operator import naming
from shardq_operator.kube import Kube
from shardq_operator.reconciling import Reconciler

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]


def stateful_set_made_by_hand(name: str) -> dict[str, Any]:
    labels = {"app": "by-hand"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "localhost/none:0"}]},
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "other"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "5Gi"}}},
                }
            ],
        },
    }


def test_a_refused_stateful_set_leaves_the_rest_of_the_pass_done_and_says_why(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    custom = client.CustomObjectsApi(api_client)
    client.AppsV1Api(api_client).create_namespaced_stateful_set(namespace, stateful_set_made_by_hand("main-shardq"))
    for plural, kind, name, spec in (
        ("shardqclusters", "ShardqCluster", "main", {"servers": 3}),
        ("queues", "Queue", "orders", {"cluster": "main", "shards": 2, "replicas": 3}),
    ):
        body = {"apiVersion": naming.API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
        custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, plural, body)

    reconciler = Reconciler(Kube(api_client))
    try:
        tick = reconciler.reconcile(namespace, "main")
    finally:
        reconciler.server_reads.stop()

    assert tick.cluster_map is not None
    assert "orders" in tick.cluster_map.placement
    leases = client.CoordinationV1Api(api_client).list_namespaced_lease(namespace).items
    assert sorted(lease.metadata.name for lease in leases) == ["orders.0", "orders.1"]
    shards = custom.list_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shards")["items"]
    assert sorted(shard["metadata"]["name"] for shard in shards) == ["orders-0", "orders-1"]
    events = client.CoreV1Api(api_client).list_namespaced_event(namespace).items
    refused = [event for event in events if event.reason == "ApplyRefused"]
    assert len(refused) == 1, [(event.reason, event.message) for event in events]
    (event,) = refused
    assert event.type == "Warning"
    assert event.involved_object.kind == "ShardqCluster"
    assert event.involved_object.name == "main"
    assert event.message.startswith("StatefulSet main-shardq: "), event.message
    assert "Forbidden" in event.message, event.message
