"""A deleted Queue's finalizer waits until every server of its cluster, those down or
starting included, has dropped the queue's data, and the Queue's Ready condition says
what it waits for: here no server is running (a control plane, no kubelet), and the
queue is also still another queue's dead-letter queue.

It used to ask only the ready servers, and so finished at once here: on the real node
a server down at the deletion kept its copy, which came back under a cluster and queue
created again with the same names and lost the acknowledged sends made since.

A real API server; the operator's own handler and reconcile, run in-process."""

from __future__ import annotations

import pathlib
from typing import Any, cast

import kopf
import pytest
from kubernetes import client
from shardq_operator import handlers, naming
from shardq_operator.kube import Kube
from shardq_operator.leadership import OperatorLeadership
from shardq_operator.reconciling import Reconciler

from shardq.coordination.local_leases import LocalLeaseStore

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def test_a_deleted_queue_waits_for_servers_that_cannot_answer_and_says_so(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], tmp_path: pathlib.Path
) -> None:
    custom = client.CustomObjectsApi(api_client)
    dead_letters = {"deadLetterQueue": "jobs-dlq", "maxReceiveCount": 3}
    for plural, kind, name, spec in (
        ("shardqclusters", "ShardqCluster", "main", {"servers": 3}),
        ("queues", "Queue", "jobs-dlq", {"cluster": "main"}),
        ("queues", "Queue", "jobs", {"cluster": "main", "redrivePolicy": dead_letters}),
    ):
        body = {"apiVersion": naming.API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
        custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, plural, body)
    reconciler = Reconciler(Kube(api_client))
    leases = LocalLeaseStore(tmp_path / "operator-lease")
    handlers.use(reconciler, OperatorLeadership(leases, identity="test"))
    try:
        reconciler.reconcile(namespace, "main")
        # Deleted as kubectl deletes it, held by a finalizer as kopf holds it.
        held = {"metadata": {"finalizers": [FINALIZER]}}
        custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", "jobs-dlq", held)
        custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", "jobs-dlq")
        queue: dict[str, Any] = custom.get_namespaced_custom_object(
            naming.GROUP, naming.VERSION, namespace, "queues", "jobs-dlq"
        )
        assert queue["metadata"].get("deletionTimestamp")
        with pytest.raises(kopf.TemporaryError) as waiting:
            handlers.queue_deleted(namespace=namespace, name="jobs-dlq", body=cast(kopf.Body, queue), retry=0)
        status = custom.get_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", "jobs-dlq")[
            "status"
        ]
    finally:
        reconciler.server_reads.stop()
        leases.close()
        released = {"metadata": {"finalizers": None}}
        custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", "jobs-dlq", released)

    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert (status["phase"], ready["status"], ready["reason"]) == ("Deleting", "False", "Deleting")
    assert ready["message"] == str(waiting.value), (ready["message"], str(waiting.value))
    assert "cannot be removed yet" in ready["message"], ready["message"]
    for server in naming.server_ids("main", 3):
        assert f"{server}: it " in ready["message"], ready["message"]
