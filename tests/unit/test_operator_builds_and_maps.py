"""The operator's pure parts: the cluster map its resources stand for, the manifests it
writes, and servers as seen through pods."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from shardq_operator import builders, naming
from shardq_operator.mapping import desired_map, servers_needed
from shardq_operator.observing import NotReady, observe_pod, observe_servers, servers_to_ask, why_not_ready
from shardq_operator.peer_secrets import cluster_peer_secret

from shardq.coordination.cluster_map import CLUSTER_MAP_KEY, cluster_map_from_text
from shardq.coordination.peer_credentials import NO_PEER_SECRET, parse_peer_secret

CLUSTER: dict[str, Any] = {
    "apiVersion": "shardq.io/v1alpha1",
    "kind": "ShardqCluster",
    "metadata": {"name": "main", "namespace": "shop", "uid": "u-1"},
    "spec": {"servers": 3, "image": "localhost/shardq:abc", "imagePullPolicy": "Never", "storage": {"size": "2Gi"}},
}


def plan(queues: dict[str, dict[str, Any]], current: Any = None, servers: int = 3) -> Any:
    return desired_map(
        cluster="main", namespace="shop", servers=servers, lease_duration_ms=10_000, queues=queues, current=current
    )


def test_queues_are_placed_on_the_cluster_pods_with_replicas_on_distinct_servers() -> None:
    result = plan({"orders": {"shards": 4, "replicas": 3}, "audit": {"cluster": "main"}})
    cluster_map = result.cluster_map
    assert sorted(cluster_map.servers) == ["main-shardq-0", "main-shardq-1", "main-shardq-2"]
    assert cluster_map.servers["main-shardq-1"].address == "main-shardq-1.main-shardq-peers.shop.svc.cluster.local:7600"
    assert len(cluster_map.placement["orders"]) == 4
    assert all(len(set(replicas)) == 3 for replicas in cluster_map.placement["orders"])
    # leaders spread: each server is the first replica of some orders shard
    assert {replicas[0] for replicas in cluster_map.placement["orders"]} == set(cluster_map.servers)
    assert result.problems == {}
    # the resource's `cluster` field is not a queue setting
    assert next(q for q in cluster_map.queues if q.name == "audit").spec == {}


def test_placement_is_sticky_and_removed_queues_leave_the_map() -> None:
    first = plan({"orders": {"shards": 2}, "audit": {}}).cluster_map
    second = plan({"orders": {"shards": 2, "visibilityTimeout": "45s"}, "billing": {"shards": 3}}, current=first)
    assert second.cluster_map.placement["orders"] == first.placement["orders"]
    assert "audit" not in second.cluster_map.placement
    assert len(second.cluster_map.placement["billing"]) == 3
    orders = next(q for q in second.cluster_map.queues if q.name == "orders")
    assert orders.config.visibility_timeout_ms == 45_000


def test_a_change_the_servers_cannot_make_is_reported_and_the_old_queue_kept() -> None:
    first = plan({"orders": {"shards": 2}}).cluster_map
    second = plan({"orders": {"shards": 5}}, current=first)
    assert "shards cannot change" in second.problems["orders"]
    assert second.cluster_map.placement["orders"] == first.placement["orders"]


def test_an_invalid_queue_or_one_needing_more_servers_is_reported_not_placed() -> None:
    result = plan({"bad": {"visibilityTimeout": "soon"}, "wide": {"replicas": 5}, "fine": {}})
    assert "visibilityTimeout" in result.problems["bad"]
    assert "wide" in result.problems
    assert sorted(result.cluster_map.placement) == ["fine"]


def test_scaling_in_keeps_servers_that_hold_replicas_and_places_new_queues_on_the_rest() -> None:
    first = plan({"orders": {"shards": 3}}).cluster_map
    shrunk = plan({"orders": {"shards": 3}, "audit": {"shards": 2, "replicas": 2}}, current=first, servers=2)
    # The third server stays in the map (and the StatefulSet) while it holds replicas...
    assert len(shrunk.cluster_map.servers) == 3
    assert servers_needed("main", 2, shrunk.cluster_map.placement) == 3
    # ...but a queue created meanwhile is placed only on the servers that remain.
    assert {server for replicas in shrunk.cluster_map.placement["audit"] for server in replicas} <= {
        "main-shardq-0",
        "main-shardq-1",
    }
    grown = plan({"orders": {"shards": 3}}, current=first, servers=5)
    assert len(grown.cluster_map.servers) == 5
    assert grown.cluster_map.placement["orders"] == first.placement["orders"]


def test_the_stateful_set_runs_servers_on_kubernetes_leases_following_the_map() -> None:
    manifest = builders.stateful_set(CLUSTER, servers=3)
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    spec = manifest["spec"]
    assert spec["replicas"] == 3
    assert spec["serviceName"] == naming.peers_service("main")
    container = spec["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--lease-store") + 1] == "kubernetes"
    assert args[args.index("--cluster-configmap") + 1] == naming.map_config("main")
    assert args[args.index("--server-id") + 1] == "$(POD_NAME)"
    assert "--queues-managed-by" in args
    assert container["image"] == "localhost/shardq:abc"
    assert container["readinessProbe"]["grpc"]["port"] == naming.GRPC_PORT
    assert spec["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert spec["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    assert spec["template"]["spec"]["serviceAccountName"] == naming.account("main")


def test_each_cluster_gets_its_own_peer_secret_derived_from_the_operators_key() -> None:
    key = parse_peer_secret("k" * 40)
    secret = cluster_peer_secret(key, namespace="shop", cluster="main", uid="u-1")
    assert secret == cluster_peer_secret(key, namespace="shop", cluster="main", uid="u-1")  # a restart: the same
    assert parse_peer_secret(secret.secret or "") == secret  # a secret the servers take
    others = [
        cluster_peer_secret(key, namespace="shop", cluster="main", uid="u-2"),  # made anew under its old name
        cluster_peer_secret(key, namespace="shop", cluster="other", uid="u-1"),
        cluster_peer_secret(key, namespace="shop2", cluster="main", uid="u-1"),
        cluster_peer_secret(key, namespace="sho", cluster="pmain", uid="u-1"),  # no joining ambiguity
        cluster_peer_secret(parse_peer_secret("j" * 40), namespace="shop", cluster="main", uid="u-1"),
    ]
    assert len({other.secret for other in [secret, *others]}) == 6
    assert cluster_peer_secret(NO_PEER_SECRET, namespace="shop", cluster="main", uid="u-1") == NO_PEER_SECRET


def test_the_servers_get_the_peer_secret_from_a_secret_volume_and_roll_when_it_changes() -> None:
    secret = parse_peer_secret("s" * 43)
    manifest = builders.peer_secret(CLUSTER, secret)
    assert (manifest["kind"], manifest["metadata"]["name"]) == ("Secret", naming.peer_secret("main"))
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # deleted with the cluster
    assert base64.b64decode(manifest["data"][naming.PEER_SECRET_KEY]).decode() == secret.secret

    template = builders.stateful_set(CLUSTER, servers=3, credential=secret)["spec"]["template"]
    container = template["spec"]["containers"][0]
    path = container["args"][container["args"].index("--peer-secret-file") + 1]
    mount = next(mount for mount in container["volumeMounts"] if path.startswith(mount["mountPath"] + "/"))
    volume = next(volume for volume in template["spec"]["volumes"] if volume["name"] == mount["name"])
    assert volume["secret"] == {"secretName": naming.peer_secret("main"), "defaultMode": 0o400}
    assert path.endswith("/" + naming.PEER_SECRET_KEY)
    assert mount["readOnly"]
    digest = template["metadata"]["annotations"]["shardq.io/peer-secret-digest"]
    assert secret.secret not in str(template)
    changed = builders.stateful_set(CLUSTER, servers=3, credential=parse_peer_secret("t" * 43))
    assert changed["spec"]["template"]["metadata"]["annotations"]["shardq.io/peer-secret-digest"] != digest

    plain = builders.stateful_set(CLUSTER, servers=3)["spec"]["template"]
    assert "--peer-secret-file" not in plain["spec"]["containers"][0]["args"]
    assert "volumes" not in plain["spec"]
    assert "annotations" not in plain["metadata"]


def test_the_servers_may_touch_only_leases_and_their_own_map() -> None:
    rules = builders.role(CLUSTER)["rules"]
    assert {rule["resources"][0] for rule in rules} == {"leases", "configmaps"}
    config_rule = next(rule for rule in rules if rule["resources"] == ["configmaps"])
    assert config_rule["resourceNames"] == [naming.map_config("main")]
    assert "delete" not in {verb for rule in rules for verb in rule["verbs"]}


def test_the_map_config_holds_the_map_the_servers_parse() -> None:
    cluster_map = plan({"orders": {"shards": 2}}).cluster_map
    manifest = builders.map_config(CLUSTER, cluster_map)
    assert cluster_map_from_text(manifest["data"][CLUSTER_MAP_KEY]) == cluster_map


def test_the_peers_service_publishes_servers_before_they_are_ready() -> None:
    spec = builders.peers_service(CLUSTER)["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is True


def pod(name: str, *, running: bool = True, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-23T10:00:05Z"
    state = {"running": {"startedAt": "2026-11-23T10:00:00Z"}} if running else {"waiting": {"reason": "x"}}
    return {
        "metadata": metadata,
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": "Running" if running else "Pending",
            "podIP": "198.18.0.7",
            "containerStatuses": [{"name": "server", "state": state}],
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-11-23T10:00:02Z"}
            ],
        },
    }


@pytest.mark.parametrize(
    ("shape", "running", "ready"),
    [
        ({}, True, True),
        ({"ready": False}, True, False),
        ({"running": False, "ready": False}, False, False),
        ({"deleting": True}, False, False),
    ],
)
def test_a_pod_is_observed_as_its_server(shape: dict[str, bool], running: bool, ready: bool) -> None:
    seen = observe_pod(pod("main-shardq-0", **shape))
    assert (seen.running, seen.ready) == (running, ready)
    if running:
        assert seen.started_at_ms == 1_795_428_000_000
    if ready:
        assert seen.ready_since_ms == 1_795_428_002_000


def test_a_pod_that_was_ready_in_this_container_and_no_longer_is_is_unready_since_then() -> None:
    paused = pod("main-shardq-0", ready=False)
    paused["status"]["conditions"][0]["lastTransitionTime"] = "2026-11-23T10:00:09Z"
    assert observe_pod(paused).unready_since_ms == 1_795_428_009_000
    # Unready since before the container started: a restarted or starting server, not a paused one.
    starting = pod("main-shardq-0", ready=False)
    starting["status"]["conditions"][0]["lastTransitionTime"] = "2026-11-23T10:00:00Z"
    assert observe_pod(starting).unready_since_ms is None
    assert observe_pod(pod("main-shardq-0")).unready_since_ms is None


def test_a_server_without_a_pod_is_not_running() -> None:
    servers = observe_servers(["main-shardq-0", "main-shardq-1"], [pod("main-shardq-0")])
    assert servers["main-shardq-0"].ready
    assert not servers["main-shardq-1"].running


def test_a_deleted_queue_waits_for_every_server_not_only_the_ready_ones() -> None:
    """The finalizer of a deleted Queue asks each server whether it still holds the data.
    It passed over servers that were not ready: a server down at the deletion kept its
    copy, which came back under a cluster and queue created again with the same names,
    and the acknowledged sends made since were lost (seen on the real node)."""
    pods = [
        pod("c1-shardq-0"),
        pod("c1-shardq-1", ready=False),
        pod("c1-shardq-2", running=False, ready=False),
        pod("c1-shardq-4"),  # a server the spec no longer counts, still running
    ]
    askable, silent = servers_to_ask(naming.server_ids("c1", 4), pods)
    assert askable == {"c1-shardq-0": "198.18.0.7:7600", "c1-shardq-4": "198.18.0.7:7600"}
    assert silent == {
        "c1-shardq-1": "it is not ready",
        "c1-shardq-2": "it is not ready",
        "c1-shardq-3": "it has no pod",
    }


def test_the_map_names_each_queue_by_its_resources_uid_from_the_first_reconcile_that_knows_it() -> None:
    before_uids = plan({"orders": {"shards": 2}}).cluster_map
    assert [q.uid for q in before_uids.queues] == [""]
    named = desired_map(
        cluster="main",
        namespace="shop",
        servers=3,
        lease_duration_ms=10_000,
        queues={"orders": {"shards": 2}},
        uids={"orders": "3f1c-uid"},
        current=before_uids,
    ).cluster_map
    assert [q.uid for q in named.queues] == ["3f1c-uid"]
    assert named.placement == before_uids.placement


def test_a_server_not_ready_is_named_with_what_its_pod_says() -> None:
    unbound = {
        "metadata": {"name": "main-shardq-1"},
        "spec": {},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
                }
            ],
        },
    }
    crashing = pod("main-shardq-2", running=False, ready=False)
    crashing["status"]["containerStatuses"][0] = {
        "name": "server",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
    }
    unpulled = pod("main-shardq-3", running=False, ready=False)
    unpulled["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": "ErrImageNeverPull", "message": 'image "localhost/shardq:x" is not present'}
    }
    creating = pod("main-shardq-4", running=False, ready=False)
    creating["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    unplaced = {"metadata": {"name": "main-shardq-5"}, "spec": {}, "status": {"phase": "Pending"}}

    assert why_not_ready(pod("main-shardq-0")) is None
    assert why_not_ready(unbound) == NotReady(
        "unschedulable", "not scheduled: 0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    )
    assert why_not_ready(crashing) == NotReady(
        "failing", "CrashLoopBackOff: back-off 40s restarting failed container (last exit code 2, Error)"
    )
    assert why_not_ready(unpulled) == NotReady(
        "failing", 'ErrImageNeverPull: image "localhost/shardq:x" is not present'
    )
    assert why_not_ready(creating) == NotReady("starting", "ContainerCreating")
    assert why_not_ready(unplaced) == NotReady("starting", "not scheduled yet")
    assert why_not_ready(pod("main-shardq-6", ready=False)) == NotReady(
        "starting", "running, not ready yet (starting, or its replicas catching up)"
    )
    assert why_not_ready(None) == NotReady("starting", "no pod yet")
