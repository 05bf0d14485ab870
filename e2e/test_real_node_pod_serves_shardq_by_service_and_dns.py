"""A pod of our image serves shardq on the real node: Ready through its gRPC health
check, reachable from the host and from another pod, by ClusterIP Service and by its
stable DNS name."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from e2e.realnode import RunningNode
from e2e.shard_workloads import GRPC_PORT, create_shard_servers, run_python_pod, wait_serving
from shardq import Client, Message

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(300)]

CLIENT_SCRIPT = """
import json, sys
from shardq import Client, Message
results = {}
for endpoint in sys.argv[1:] or ENDPOINTS:
    with Client(endpoint) as c:
        sent = c.send_messages("orders", [Message(b"from a pod via " + endpoint.encode())])
        results[endpoint] = sent[0].message_id
print(json.dumps(results))
"""


def test_a_shard_server_pod_answers_the_host_and_other_pods(real_node: RunningNode, node_namespace: str) -> None:
    info = real_node.info
    with info.api_client() as api:
        servers = create_shard_servers(
            api, node_namespace, name="shard", image=info.shardq_image, replicas=1, queue="orders:shards=2"
        )
        core = client.CoreV1Api(api)
        service_ip = core.read_namespaced_service("shard", node_namespace).spec.cluster_ip
        pod_ip = core.read_namespaced_pod("shard-0", node_namespace).status.pod_ip

        # From the host: by pod address and through the Service's ClusterIP (kube-proxy).
        wait_serving(f"{service_ip}:{GRPC_PORT}")
        with Client(f"{pod_ip}:{GRPC_PORT}") as direct:
            direct.send_messages("orders", [Message(b"from the host, direct")])
        with Client(f"{service_ip}:{GRPC_PORT}") as via_service:
            via_service.send_messages("orders", [Message(b"from the host, via the Service")])

        # From another pod: by the stable DNS name and by the Service's DNS name.
        endpoints = [f"{servers.pod_dns_name(0)}:{GRPC_PORT}", f"{servers.service_dns_name}:{GRPC_PORT}"]
        script = CLIENT_SCRIPT.replace("ENDPOINTS", json.dumps(endpoints))
        phase, logs = run_python_pod(api, node_namespace, name="client", image=info.shardq_image, script=script)
        assert phase == "Succeeded", logs
        assert set(json.loads(logs.strip().splitlines()[-1])) == set(endpoints)

        with Client(f"{service_ip}:{GRPC_PORT}") as consumer:
            bodies = set()
            for _ in range(20):
                for message in consumer.receive_messages("orders", max_messages=10, wait_time_ms=500):
                    bodies.add(message.body)
                    consumer.delete_messages("orders", [message.receipt])
                if len(bodies) == 4:
                    break
        assert bodies == {
            b"from the host, direct",
            b"from the host, via the Service",
            *(b"from a pod via " + endpoint.encode() for endpoint in endpoints),
        }
