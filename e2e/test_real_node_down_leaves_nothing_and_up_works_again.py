"""`down` leaves no process, mount, bridge, iptables rule or address behind, even with a
pod running, and `up` after `down` gives a working node again."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.realnode import NODE, RunningNode, leftovers, status
from e2e.shard_workloads import create_shard_servers

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(300)]


def test_down_leaves_nothing_behind_and_up_works_again(real_node: RunningNode, node_namespace: str) -> None:
    layout = real_node.own_node("its host state")
    with real_node.info.api_client() as api:
        create_shard_servers(
            api, node_namespace, name="shard", image=real_node.info.shardq_image, replicas=1, queue="orders"
        )
    before = leftovers(layout)
    assert before.processes, "a node that is up runs processes"
    assert before.mounts, "a running pod has mounts (rootfs, volumes, network namespace)"
    assert before.bridge, "a running pod is on the bridge"
    assert before.iptables_rules, "kube-proxy has programmed rules"
    assert before.node_address, "the node's address is on lo"

    remains = real_node.restart()

    assert remains.clean, f"left behind after down: {remains}"
    healthy, line = status(layout)
    assert healthy, line
    with real_node.info.api_client() as api:
        node = client.CoreV1Api(api).read_node(NODE.name)
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
