"""The operator on the real node: a ShardqCluster of 3 server pods hosting Queues, used
from the host; a leader pod deleted and its shards failed over without losing an
acknowledged message; a Queue added to the running cluster and one deleted, without
restarting a pod."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from e2e.crds import install_crds
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from e2e.processes import server_pid
from e2e.realnode import RunningNode
from shardq import Client, Message, ShardqError
from shardq.api.v1 import queue_pb2, queue_pb2_grpc, replication_pb2, replication_pb2_grpc
from shardq.coordination.peer_credentials import PEER_SECRET_HEADER
from tests.support.ports import free_port

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(600)]

GROUP, VERSION = "shardq.io", "v1alpha1"
READY_S = 240.0


def apply(api: client.ApiClient, namespace: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def create_cluster(api: client.ApiClient, namespace: str, image: str, **spec: Any) -> None:
    """ShardqCluster `main`: 3 servers of the node's image, 3 s leases, small volumes."""
    defaults = {"servers": 3, "image": image, "imagePullPolicy": "Never", "leaseDuration": "3s"}
    apply(api, namespace, "shardqclusters", "ShardqCluster", "main", {**defaults, "storage": {"size": "100Mi"}, **spec})


def get(api: client.ApiClient, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return found


def queue_ready(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The queue once every shard is led and every replica in sync (what a platform team
    waits for before trusting it)."""
    queue = get(api, namespace, "queues", name)
    conditions = {c["type"]: c["status"] for c in (queue or {}).get("status", {}).get("conditions", [])}
    settled = conditions.get("Ready") == "True" and conditions.get("UnderReplicated") == "False"
    return queue if settled else None


def cluster_state(api: client.ApiClient, namespace: str, logs: list[Path]) -> str:
    """What a timed-out wait shows: every queue's conditions, every shard's leader, epoch
    and in-sync replicas, the server pods (with the log of each one not ready), and the
    operators' logs."""
    lines = []
    for queue in client.CustomObjectsApi(api).list_namespaced_custom_object(GROUP, VERSION, namespace, "queues")[
        "items"
    ]:
        conditions = [
            f"{c['type']}={c['status']} ({c.get('reason', '')}: {c.get('message', '')})"
            for c in queue.get("status", {}).get("conditions", [])
        ]
        lines.append(f"queue {queue['metadata']['name']}: {'; '.join(conditions) or 'no status'}")
    for shard in client.CustomObjectsApi(api).list_namespaced_custom_object(GROUP, VERSION, namespace, "shards")[
        "items"
    ]:
        status = shard.get("status", {})
        lines.append(
            f"shard {shard['metadata']['name']}: leader {status.get('leader', '')!r} epoch {status.get('epoch', 0)} "
            f"isr {status.get('isr', [])} replicas {shard['spec'].get('replicas', [])}"
        )
    for pod in client.CoreV1Api(api).list_namespaced_pod(namespace).items:
        ready = [c.status for c in pod.status.conditions or [] if c.type == "Ready"]
        restarts = [s.restart_count for s in pod.status.container_statuses or []]
        lines.append(f"pod {pod.metadata.name}: {pod.status.phase} ready {ready} restarts {restarts}")
        if ready != ["True"]:
            try:
                said = client.CoreV1Api(api).read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=40)
            except ApiException as error:
                said = f"(no log: {error.status} {error.reason})"
            lines.append(f"--- pod {pod.metadata.name} (last 40 lines)\n{said}")
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        lines.append(f"--- {log.name} (last 40 lines)\n" + "\n".join(text.splitlines()[-40:]))
    return "\n".join(lines)


def shard_leaders(api: client.ApiClient, namespace: str, queue: str) -> dict[int, tuple[str, int]]:
    shards = client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, "shards", label_selector=f"shardq.io/queue={queue}"
    )["items"]
    return {
        s["spec"]["index"]: (s.get("status", {}).get("leader", ""), s.get("status", {}).get("epoch", 0)) for s in shards
    }


def busiest_pod(leaders: dict[int, tuple[str, int]]) -> tuple[str, list[int]]:
    """The pod leading the most shards (first by name among equals) and up to two of them."""
    led: dict[str, list[int]] = {}
    for index, (leader, _) in sorted(leaders.items()):
        led.setdefault(leader, []).append(index)
    busiest = max(sorted(led), key=lambda server: len(led[server]))
    return busiest, led[busiest][:2]


def drain(endpoint: str, queue: str, expected: int, *, timeout: float = 60) -> set[bytes]:
    bodies: set[bytes] = set()
    deadline = time.monotonic() + timeout
    with Client(endpoint, route_directly=False) as consumer:
        while len(bodies) < expected and time.monotonic() < deadline:
            try:
                messages = consumer.receive_messages(queue, max_messages=10, wait_time_ms=500)
                for message in messages:
                    bodies.add(message.body)
                if messages:
                    consumer.delete_messages(queue, [m.receipt for m in messages])
            except ShardqError:
                time.sleep(0.2)  # leadership is moving: ask again
    return bodies


def send_all(endpoint: str, queue: str, bodies: list[bytes], *, group: str = "", timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with Client(endpoint, route_directly=False) as producer:
        for body in bodies:
            while True:
                try:
                    # A dedup id makes a retry after an unknown outcome safe.
                    producer.send_messages(queue, [Message(body, dedup_id=body.decode(), group_id=group)])
                    break
                except ShardqError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)


def assert_only_peers_get_replication_answers(core: client.CoreV1Api, namespace: str, pod: str) -> None:
    secret = core.read_namespaced_secret("main-shardq-peer", namespace)
    assert [owner.kind for owner in secret.metadata.owner_references] == ["ShardqCluster"]
    peer = ((PEER_SECRET_HEADER, base64.b64decode(secret.data["secret"]).decode()),)
    pod_ip = core.read_namespaced_pod(pod, namespace).status.pod_ip
    with grpc.insecure_channel(f"{pod_ip}:7600") as channel:
        stub = replication_pb2_grpc.ReplicationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        answer = stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), metadata=peer, timeout=5)
        assert answer.server_id == pod


def test_queues_on_a_cluster_serve_fail_over_and_change_without_restarts(
    real_node: RunningNode, node_namespace: str, tmp_path: Path
) -> None:
    info = real_node.info
    namespace = node_namespace
    metrics_port = free_port()
    operator = running_operator(info.kubeconfig, namespace, tmp_path / "operator.log", metrics_port=metrics_port)
    with info.api_client() as api, operator:
        install_crds(api)
        create_cluster(api, namespace, info.shardq_image)
        apply(api, namespace, "queues", "Queue", "orders-dlq", {"cluster": "main", "shards": 1, "replicas": 3})
        apply(
            api, namespace, "queues", "Queue", "orders",
            {"cluster": "main", "shards": 2, "replicas": 3,
             "redrivePolicy": {"deadLetterQueue": "orders-dlq", "maxReceiveCount": 3}},
        )  # fmt: skip
        for name in ("orders", "orders-dlq"):
            wait_for(
                lambda name=name: queue_ready(api, namespace, name),
                timeout=READY_S,
                what=f"queue {name} Ready\n{(tmp_path / 'operator.log').read_text()[-3000:]}",
            )
        core = client.CoreV1Api(api)
        service_ip = core.read_namespaced_service("main-shardq", namespace).spec.cluster_ip
        endpoint = f"{service_ip}:7600"
        pods_before = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
        assert sorted(pods_before) == ["main-shardq-0", "main-shardq-1", "main-shardq-2"]

        first = [f"before-{n}".encode() for n in range(20)]
        send_all(endpoint, "orders", first)
        # `kubectl get queues` shows the depth (read from the servers every few seconds).
        wait_for(
            lambda: (get(api, namespace, "queues", "orders") or {}).get("status", {}).get("visible") == 20,
            timeout=30,
            what="the queue's status to show 20 visible messages",
        )

        # `kubectl get shards` shows each shard's depth and commit index, as its leader reports them.
        def shard_depths() -> list[int] | None:
            shards = client.CustomObjectsApi(api).list_namespaced_custom_object(
                GROUP, VERSION, namespace, "shards", label_selector="shardq.io/queue=orders"
            )["items"]
            statuses = [shard.get("status", {}) for shard in shards]
            if len(statuses) != 2 or sum(status.get("depth", 0) for status in statuses) != 20:
                return None
            assert all(status.get("commitIndex", 0) >= status["depth"] for status in statuses), statuses
            return [status["depth"] for status in statuses]

        wait_for(shard_depths, timeout=30, what="the Shards' status to show 20 messages between them")
        # Those depths came from the servers' replication status, which only peers may ask:
        # the operator derives the cluster's secret, which the pods have from its Secret.
        assert_only_peers_get_replication_answers(core, namespace, "main-shardq-0")
        leaders = shard_leaders(api, namespace, "orders")
        assert sorted(leaders) == [0, 1]
        assert all(leader.startswith("main-shardq-") for leader, _ in leaders.values())

        # The leader of shard 0 crashes and its pod goes away: another in-sync replica takes
        # over. (A pod deleted with its server running would hand leadership off itself on
        # SIGTERM; the SIGKILL first leaves the failover to the operator.)
        victim, epoch = leaders[0]
        os.kill(server_pid(namespace, victim), signal.SIGKILL)
        core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
        deleted_at = time.monotonic()

        def failed_over() -> tuple[str, int] | None:
            leader, now_epoch = shard_leaders(api, namespace, "orders").get(0, ("", 0))
            return (leader, now_epoch) if now_epoch > epoch and leader and leader != victim else None

        new_leader, new_epoch = wait_for(failed_over, timeout=60, what=f"shard 0 failing over from {victim}")
        after = [f"after-{n}".encode() for n in range(20)]
        send_all(endpoint, "orders", after)
        print(
            f"failover: {victim} -> {new_leader} epoch {epoch} -> {new_epoch} in {time.monotonic() - deleted_at:.1f}s"
        )
        assert drain(endpoint, "orders", 40) == set(first) | set(after)
        # The operator counted the takeover and timed it from the pod's disappearance.
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        samples = {
            (sample.name, sample.labels.get("reason", "")): sample.value
            for family in text_string_to_metric_families(scraped)
            for sample in family.samples
        }
        assert samples[("shardq_operator_takeovers_total", "holder-died")] >= 1
        assert samples[("shardq_operator_failover_seconds_count", "")] >= 1
        assert samples[("shardq_operator_reconciles_total", "")] >= 1

        # A new queue on the running cluster, and a queue deleted: no server restarts.
        wait_for(
            lambda: len([p for p in core.list_namespaced_pod(namespace).items if p.status.phase == "Running"]) == 3,
            timeout=READY_S,
            what="the replaced pod",
        )
        apply(api, namespace, "queues", "Queue", "audit", {"cluster": "main", "shards": 1, "replicas": 2, "fifo": True})
        # Its first shard's leader is the first server by name, which may be the pod just
        # replaced, and the queue is Ready once that pod is (ci59 timed out here once: the
        # state at the timeout says which pod, lease and ISR it waited for).
        wait_for(
            lambda: queue_ready(api, namespace, "audit"),
            timeout=60,
            what="queue audit Ready",
            explain=lambda: cluster_state(api, namespace, [tmp_path / "operator.log"]),
        )
        send_all(endpoint, "audit", [b"first", b"second"], group="g")
        assert drain(endpoint, "audit", 2) == {b"first", b"second"}

        client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", "audit")
        # ci70 timed out here once, the replaced pod not ready for the whole minute: the
        # state at the timeout says why.
        wait_for(
            lambda: get(api, namespace, "queues", "audit") is None,
            timeout=60,
            what="queue audit deleted",
            explain=lambda: cluster_state(api, namespace, [tmp_path / "operator.log"]),
        )
        # Its Shard objects go with it (the garbage collector follows their owner reference).
        wait_for(lambda: shard_leaders(api, namespace, "audit") == {}, timeout=60, what="audit's Shards removed")
        with Client(endpoint, route_directly=False) as admin:
            assert "audit" not in admin.list_queues()
        pods_after = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
        unchanged = {name for name in pods_before if name != victim}
        assert {name: pods_after[name] for name in unchanged} == {name: pods_before[name] for name in unchanged}

        # A cluster with queues on it is not deleted.
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            GROUP, VERSION, namespace, "shardqclusters", "main"
        )
        time.sleep(3)
        blocked = get(api, namespace, "shardqclusters", "main")
        assert blocked is not None
        events = core.list_namespaced_event(namespace, field_selector="reason=DeletionBlocked").items
        assert any("orders" in event.message for event in events)
        for name in ("orders", "orders-dlq"):
            client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", name)
        wait_for(lambda: get(api, namespace, "shardqclusters", "main") is None, timeout=120, what="the cluster deleted")

        # The shard Leases belonged to the cluster: the garbage collector removes them with it.
        def shard_leases() -> list[str]:
            listed = client.CoordinationV1Api(api).list_namespaced_lease(namespace).items
            return sorted(lease.metadata.name for lease in listed if lease.metadata.name != "shardq-operator")

        wait_for(lambda: shard_leases() == [], timeout=60, what=f"the shard Leases collected (left: {shard_leases()})")


def test_leadership_moves_off_a_pod_whose_shards_are_hot(
    real_node: RunningNode, node_namespace: str, tmp_path: Path
) -> None:
    info = real_node.info
    namespace = node_namespace
    metrics_port = free_port()
    operator = running_operator(info.kubeconfig, namespace, tmp_path / "operator.log", metrics_port=metrics_port)
    with info.api_client() as api, operator:
        install_crds(api)
        create_cluster(api, namespace, info.shardq_image, rebalance={"mode": "auto", "maxMovesPerMinute": 6})
        # Six shards on three servers: each server leads two.
        apply(api, namespace, "queues", "Queue", "hot", {"cluster": "main", "shards": 6, "replicas": 3})
        wait_for(lambda: queue_ready(api, namespace, "hot"), timeout=READY_S, what="queue hot Ready")
        leaders = shard_leaders(api, namespace, "hot")
        # Placement spreads leaders two per server, but pods starting in turn may have
        # shifted some: take the server leading the most (at least two of six).
        busiest, hot = busiest_pod(leaders)
        assert len(hot) == 2, leaders
        service_ip = client.CoreV1Api(api).read_namespaced_service("main-shardq", namespace).spec.cluster_ip

        # About 40 sends a second to the two shards `busiest` leads, until one of them moves
        # (bounded: at most 60 s).
        moved: dict[int, tuple[str, int]] = {}
        deadline = time.monotonic() + 60
        sent = 0
        next_look = time.monotonic() + 1
        with grpc.insecure_channel(f"{service_ip}:7600") as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            while time.monotonic() < deadline and not moved:
                for index in hot:
                    request = queue_pb2.SendMessagesRequest(
                        queue="hot", shard=index, messages=[queue_pb2.MessageToSend(body=b"x" * 64)]
                    )
                    with contextlib.suppress(grpc.RpcError):  # a moving leader refuses briefly
                        stub.SendMessages(request, timeout=5)
                        sent += 1
                time.sleep(0.05)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + 1
                    now = shard_leaders(api, namespace, "hot")
                    moved = {index: now[index] for index in hot if now[index][0] != busiest}
        assert moved, f"no hot shard moved off {busiest} after {sent} sends"
        ((index, (new_leader, _)),) = moved.items()  # one move at a time
        assert new_leader != busiest
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        rebalanced = [
            sample.value
            for family in text_string_to_metric_families(scraped)
            for sample in family.samples
            if sample.name == "shardq_operator_takeovers_total" and sample.labels.get("reason") == "rebalance"
        ]
        assert rebalanced
        assert rebalanced[0] >= 1
        events = client.CoreV1Api(api).list_namespaced_event(namespace, field_selector="reason=Rebalance").items
        assert any(f"hot.{index}" in event.message for event in events)
        client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", "hot")
        wait_for(lambda: get(api, namespace, "queues", "hot") is None, timeout=60, what="queue hot deleted")


def test_a_standby_operator_takes_over_when_the_active_one_is_killed(
    real_node: RunningNode, node_namespace: str, tmp_path: Path
) -> None:
    info = real_node.info
    namespace = node_namespace
    with contextlib.ExitStack() as running, info.api_client() as api:
        install_crds(api)
        operators = {
            identity: running.enter_context(
                running_operator(info.kubeconfig, namespace, tmp_path / f"{identity}.log", identity=identity)
            )
            for identity in ("op-a", "op-b")
        }
        create_cluster(api, namespace, info.shardq_image, rebalance={"mode": "off"})
        apply(api, namespace, "queues", "Queue", "orders", {"cluster": "main", "shards": 2, "replicas": 3})
        wait_for(lambda: queue_ready(api, namespace, "orders"), timeout=READY_S, what="queue orders Ready")
        leases = client.CoordinationV1Api(api)
        active = leases.read_namespaced_lease("shardq-operator", namespace).spec.holder_identity
        assert active in operators
        standby = next(identity for identity in operators if identity != active)

        # The active operator dies; then a leader pod does, its server killed first: a pod
        # deleted alone gets SIGTERM, and its server hands its shards off by itself, which
        # would leave the standby nothing to do.
        operators[active].kill()
        operators[active].wait(timeout=10)
        victim, epoch = shard_leaders(api, namespace, "orders")[0]
        os.kill(server_pid(namespace, victim), signal.SIGKILL)
        client.CoreV1Api(api).delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
        killed_at = time.monotonic()

        def failed_over() -> tuple[str, int] | None:
            leader, now_epoch = shard_leaders(api, namespace, "orders").get(0, ("", 0))
            return (leader, now_epoch) if now_epoch > epoch and leader and leader != victim else None

        wait_for(failed_over, timeout=60, what=f"the standby {standby} failing shard 0 over from {victim}")
        print(f"standby failover: {time.monotonic() - killed_at:.1f}s after the active operator and the pod died")
        assert leases.read_namespaced_lease("shardq-operator", namespace).spec.holder_identity == standby
        # And it handles new resources.
        apply(api, namespace, "queues", "Queue", "audit", {"cluster": "main", "shards": 1, "replicas": 2})
        wait_for(
            lambda: queue_ready(api, namespace, "audit"),
            timeout=60,
            what="queue audit Ready under the standby",
            explain=lambda: cluster_state(api, namespace, [tmp_path / f"{identity}.log" for identity in operators]),
        )
        endpoint = f"{client.CoreV1Api(api).read_namespaced_service('main-shardq', namespace).spec.cluster_ip}:7600"
        send_all(endpoint, "audit", [b"after the takeover"])
        assert drain(endpoint, "audit", 1) == {b"after the takeover"}
        for name in ("audit", "orders"):
            client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", name)
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            GROUP, VERSION, namespace, "shardqclusters", "main"
        )
        wait_for(lambda: get(api, namespace, "shardqclusters", "main") is None, timeout=120, what="the cluster deleted")


def test_a_replica_moves_when_leadership_alone_cannot_cool_a_hot_pod(
    real_node: RunningNode, node_namespace: str, tmp_path: Path
) -> None:
    """Two hot shards on one pod with no followers (replicas 1): no leadership move can help,
    so one shard's replica is copied to a cooler pod, leadership handed to it, and the old
    copy dropped; every acknowledged message is still there."""
    info = real_node.info
    namespace = node_namespace
    operator = running_operator(info.kubeconfig, namespace, tmp_path / "operator.log")
    with info.api_client() as api, operator:
        install_crds(api)
        create_cluster(
            api,
            namespace,
            info.shardq_image,
            rebalance={"mode": "auto", "maxMovesPerMinute": 6, "imbalanceThreshold": 1.25},
        )
        apply(api, namespace, "queues", "Queue", "spread", {"cluster": "main", "shards": 4, "replicas": 1})
        wait_for(lambda: queue_ready(api, namespace, "spread"), timeout=READY_S, what="queue spread Ready")
        leaders = shard_leaders(api, namespace, "spread")
        busiest, hot = busiest_pod(leaders)
        assert len(hot) == 2, f"4 shards on 3 pods: one pod leads two ({leaders})"
        service_ip = client.CoreV1Api(api).read_namespaced_service("main-shardq", namespace).spec.cluster_ip

        # About 40 sends a second to the two shards `busiest` leads, until one of them has
        # moved (bounded: at most 120 s).
        acknowledged: set[bytes] = set()
        moved: dict[int, str] = {}
        deadline = time.monotonic() + 120
        next_look = time.monotonic() + 1
        with grpc.insecure_channel(f"{service_ip}:7600") as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            while time.monotonic() < deadline and not moved:
                for index in hot:
                    body = f"{index}-{len(acknowledged)}-{time.monotonic_ns()}".encode()
                    request = queue_pb2.SendMessagesRequest(
                        queue="spread", shard=index, messages=[queue_pb2.MessageToSend(body=body)]
                    )
                    with contextlib.suppress(grpc.RpcError):  # a moving leader refuses briefly
                        response = stub.SendMessages(request, timeout=5)
                        if not response.results[0].HasField("error"):
                            acknowledged.add(body)
                time.sleep(0.05)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + 1
                    shards = client.CustomObjectsApi(api).list_namespaced_custom_object(
                        GROUP, VERSION, namespace, "shards", label_selector="shardq.io/queue=spread"
                    )["items"]
                    for shard in shards:
                        index, replicas = shard["spec"]["index"], shard["spec"]["replicas"]
                        leader = shard.get("status", {}).get("leader", "")
                        if index in hot and replicas == [leader] and leader != busiest:
                            moved[index] = leader
        assert moved, f"no hot shard's replica moved off {busiest} after {len(acknowledged)} sends"
        events = client.CoreV1Api(api).list_namespaced_event(namespace).items
        finished = [event for event in events if event.reason == "ReplicaMoveFinished"]
        assert any(f"spread.{index}" in event.message for event in finished for index in moved)
        # Nothing acknowledged was lost on the way.
        received = drain(f"{service_ip}:7600", "spread", len(acknowledged), timeout=120)
        assert acknowledged <= received, f"{len(acknowledged - received)} acknowledged messages missing"
        client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", "spread")
        wait_for(lambda: get(api, namespace, "queues", "spread") is None, timeout=60, what="queue spread deleted")
