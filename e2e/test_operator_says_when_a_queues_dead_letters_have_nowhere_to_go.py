"""A Queue whose dead-letter queue is not a Queue of its cluster (a typo, or not made
yet) says so in its Degraded condition: its servers keep the messages that reached
maxReceiveCount, no longer delivered, until that queue is made. It used to say that
the queue ran as specified.

A real API server; the operator's own reconcile, run in-process."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from shardq_operator import naming
from shardq_operator.kube import Kube
from shardq_operator.reconciling import Reconciler

from e2e.crds import status_condition

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]


def test_a_queue_whose_dead_letter_queue_is_missing_is_degraded_until_it_is_made(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str]
) -> None:
    custom = client.CustomObjectsApi(api_client)

    def create(plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
        body = {"apiVersion": naming.API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
        custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, plural, body)

    create("shardqclusters", "ShardqCluster", "main", {"servers": 3})
    create(
        "queues",
        "Queue",
        "jobs",
        {"cluster": "main", "redrivePolicy": {"deadLetterQueue": "job-dlq", "maxReceiveCount": 3}},
    )
    reconciler = Reconciler(Kube(api_client))
    try:
        reconciler.reconcile(namespace, "main")
        missing = status_condition(api_client, namespace, "queues", "jobs", "Degraded")
        create("queues", "Queue", "job-dlq", {"cluster": "main"})
        reconciler.reconcile(namespace, "main")
        made = status_condition(api_client, namespace, "queues", "jobs", "Degraded")
    finally:
        reconciler.server_reads.stop()

    assert (missing["status"], missing["reason"]) == ("True", "DeadLetterQueueMissing"), missing
    assert "'job-dlq' is not a Queue of this cluster" in missing["message"], missing["message"]
    assert "received 3 times" in missing["message"], missing["message"]
    assert (made["status"], made["reason"]) == ("False", "AsSpecified"), made
