"""A StatefulSet of three shard servers on real PersistentVolumeClaims: a deleted pod and a
SIGKILLed container both come back on the same volume, with every acknowledged message."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.polling import wait_for
from e2e.realnode import RunningNode
from e2e.shard_workloads import (
    GRPC_PORT,
    create_shard_servers,
    delete_pod_and_wait_replaced,
    pod,
    sigkill_server_process,
    wait_serving,
)
from shardq import Client, Message

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(420)]

SERVERS = 3
PER_SERVER = 50


def endpoint_of(api: client.ApiClient, namespace: str, name: str) -> str:
    return f"{pod(api, namespace, name).status.pod_ip}:{GRPC_PORT}"


def stored_bodies(endpoint: str) -> set[bytes]:
    """Every stored message's body, looked at without consuming (claimed briefly, released)."""
    wait_serving(endpoint)
    with Client(endpoint) as shard_client:
        seen: dict[str, bytes] = {}
        receipts = []
        for _ in range(50):
            batch = shard_client.receive_messages("orders", max_messages=10, visibility_timeout_ms=60_000)
            if not batch:
                break
            for message in batch:
                seen[message.message_id] = message.body
                receipts.append(message.receipt)
        shard_client.release_messages("orders", receipts)
    return set(seen.values())


def test_deleted_and_killed_pods_come_back_with_every_acknowledged_message(
    real_node: RunningNode, node_namespace: str
) -> None:
    info = real_node.info
    with info.api_client() as api:
        servers = create_shard_servers(
            api, node_namespace, name="shard", image=info.shardq_image, replicas=SERVERS, queue="orders:shards=2"
        )
        core = client.CoreV1Api(api)
        claims = {
            claim.metadata.name: claim.spec.volume_name
            for claim in core.list_namespaced_persistent_volume_claim(node_namespace).items
        }
        assert sorted(claims) == [f"data-shard-{n}" for n in range(SERVERS)]
        assert all(claims.values()), f"every claim bound to a local volume: {claims}"

        acknowledged: dict[int, set[bytes]] = {}
        for ordinal in range(SERVERS):
            endpoint = endpoint_of(api, node_namespace, f"shard-{ordinal}")
            wait_serving(endpoint)
            with Client(endpoint) as producer:
                bodies = [b"server %d message %d" % (ordinal, n) for n in range(PER_SERVER)]
                producer.send_messages("orders", [Message(body) for body in bodies])
                acknowledged[ordinal] = set(bodies)

        # kubectl delete pod: a new pod (new UID) on the same claim and volume.
        replaced = delete_pod_and_wait_replaced(api, servers, 1)
        assert replaced.spec.volumes[0].persistent_volume_claim.claim_name == "data-shard-1"
        assert stored_bodies(endpoint_of(api, node_namespace, "shard-1")) == acknowledged[1]

        # SIGKILL of the container's server process: the kubelet restarts the container.
        sigkill_server_process(info.kubectl_command(), node_namespace, "shard-2")

        def restarted() -> bool:
            status = pod(api, node_namespace, "shard-2").status
            container = status.container_statuses[0]
            return container.restart_count >= 1 and bool(container.ready)

        wait_for(restarted, timeout=120, what="shard-2's container restarted and Ready", interval=0.5)
        assert stored_bodies(endpoint_of(api, node_namespace, "shard-2")) == acknowledged[2]
        assert stored_bodies(endpoint_of(api, node_namespace, "shard-0")) == acknowledged[0]
        # The claims are still bound to the same volumes.
        after = {
            claim.metadata.name: claim.spec.volume_name
            for claim in core.list_namespaced_persistent_volume_claim(node_namespace).items
        }
        assert after == claims
