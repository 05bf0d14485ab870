"""One cluster map for every reader, and lease names that are always Kubernetes object names."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardq.coordination.cluster_map import (
    ClusterMap,
    QueueEntry,
    ServerEntry,
    change_between,
    cluster_map_from_text,
    cluster_map_to_text,
    lease_label,
    lease_name,
    place_queues,
    read_cluster_map,
    with_queue_added,
    with_queue_changed,
    with_queue_removed,
    write_cluster_map,
)
from shardq.coordination.placement import ShardId

# metadata.name of a Lease: a DNS subdomain (RFC 1123), at most 253 characters.
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def is_object_name(name: str) -> bool:
    return len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name) is not None


def test_a_queue_name_that_is_a_dns_label_names_its_leases_as_written() -> None:
    assert lease_name(ShardId("orders", 0)) == "orders.0"
    assert lease_name(ShardId("orders-dlq", 15)) == "orders-dlq.15"
    assert lease_name(ShardId("a" * 63, 7)) == "a" * 63 + ".7"


@pytest.mark.parametrize("queue", ["Orders", "orders_v2", "-orders", "orders-", "a" * 64, "émile", "", "a.b", "UP_PER"])
def test_a_name_that_is_not_a_dns_label_maps_to_a_valid_object_name(queue: str) -> None:
    name = lease_name(ShardId(queue, 3))
    assert is_object_name(name), name
    label, _, index = name.rpartition(".")
    assert DNS_LABEL.fullmatch(label)
    assert index == "3"
    assert lease_name(ShardId(queue, 3)) == name  # deterministic: every reader finds the same Lease


def test_names_that_differ_only_in_illegal_characters_get_distinct_leases() -> None:
    labels = {lease_label(queue) for queue in ["Orders", "orders_", "ORDERS", "Orders!", "orders "]}
    assert len(labels) == 5


@given(st.text(min_size=1, max_size=300), st.integers(min_value=0, max_value=10_000))
def test_every_queue_name_maps_to_a_valid_lease_name(queue: str, index: int) -> None:
    assert is_object_name(lease_name(ShardId(queue, index)))


def test_a_negative_shard_index_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        lease_name(ShardId("orders", -1))


def sample_map() -> ClusterMap:
    queues = [QueueEntry("orders", {"shards": 4, "replicas": 3}), QueueEntry("orders-dlq", {})]
    servers = {f"s{n}": ServerEntry(f"s{n}", f"10.0.0.{n}:7600") for n in (1, 2, 3)}
    return ClusterMap(servers=servers, queues=queues, placement=place_queues(queues, list(servers)))


def test_the_map_round_trips_through_its_file(tmp_path: pathlib.Path) -> None:
    cluster = sample_map()
    read = read_cluster_map(write_cluster_map(tmp_path / "cluster.json", cluster))
    assert read == cluster
    assert read.shards_on("s2", "orders") == [i for i, r in enumerate(cluster.placement["orders"]) if "s2" in r]
    assert read.address_of("s3") == "10.0.0.3:7600"
    assert read.address_of("nobody") == ""
    assert [config.name for config in read.queue_configs()] == ["orders", "orders-dlq"]


def test_a_map_without_metrics_addresses_or_lease_duration_still_parses() -> None:
    text = json.dumps(
        {
            "servers": {"s1": {"address": "127.0.0.1:1"}},
            "queues": [{"name": "orders"}],
            "placement": {"orders": [["s1"]]},
        }
    )
    cluster = cluster_map_from_text(text)
    assert cluster.servers["s1"].metrics_address == ""
    assert cluster.lease_duration_ms > 0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["placement"].pop("orders"), "needs a placement"),
        (lambda d: d["placement"]["orders"][0].append("s9"), "distinct known servers"),
        (lambda d: d["queues"].append(dict(d["queues"][0])), "unique"),
        (lambda d: d.update(lease_duration_ms=0), "positive"),
        (lambda d: d.pop("servers"), "not a valid cluster map"),
    ],
)
def test_a_broken_map_is_refused_with_a_reason(edit: object, message: str) -> None:
    data = json.loads(cluster_map_to_text(sample_map()))
    edit(data)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        cluster_map_from_text(json.dumps(data))


def test_text_that_is_not_json_is_refused() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        cluster_map_from_text("{servers")
    with pytest.raises(ValueError, match="top level"):
        cluster_map_from_text("[]")


def test_an_added_queue_is_placed_on_the_servers_and_a_name_can_be_used_once() -> None:
    cluster = sample_map()
    grown = with_queue_added(cluster, QueueEntry("payments", {"shards": 2, "replicas": 2}))
    assert [queue.name for queue in grown.queues] == ["orders", "orders-dlq", "payments"]
    assert len(grown.placement["payments"]) == 2
    assert all(
        len(set(replicas)) == 2 and set(replicas) <= set(cluster.servers) for replicas in grown.placement["payments"]
    )
    assert grown.placement["orders"] == cluster.placement["orders"]  # nothing else moves
    with pytest.raises(ValueError, match="exists already"):
        with_queue_added(grown, QueueEntry("payments", {}))
    with pytest.raises(ValueError, match="payments"):
        with_queue_added(cluster, QueueEntry("payments", {"replicas": 4}))  # more replicas than servers


def test_queues_added_one_by_one_take_turns_leading_on_every_server() -> None:
    # Every server tied when the planner had no loads, so each new queue's shard 0 led on
    # the first server by name: ten single-shard queues made ten leaders on s1.
    servers = {name: ServerEntry(name, f"127.0.0.1:{7600 + n}") for n, name in enumerate(["s1", "s2", "s3"])}
    cluster = ClusterMap(servers=servers, queues=[], placement={})
    for number in range(9):
        cluster = with_queue_added(cluster, QueueEntry(f"q{number}", {"replicas": 2}))
    leaders = [cluster.placement[f"q{number}"][0][0] for number in range(9)]
    hosted = [replica for shards in cluster.placement.values() for replicas in shards for replica in replicas]
    assert sorted(leaders) == ["s1"] * 3 + ["s2"] * 3 + ["s3"] * 3
    assert sorted(hosted) == ["s1"] * 6 + ["s2"] * 6 + ["s3"] * 6
    # A server being drained is left out, and counts for nothing among the others.
    spread = with_queue_added(cluster, QueueEntry("late", {"shards": 2}), on=["s2", "s3"])
    assert sorted(replicas[0] for replicas in spread.placement["late"]) == ["s2", "s3"]


@given(server_count=st.integers(1, 9), queue_count=st.integers(1, 30), data=st.data())
def test_one_shard_queues_keep_leaders_and_replicas_even_on_any_cluster(
    server_count: int, queue_count: int, data: st.DataObject
) -> None:
    replicas = data.draw(st.integers(1, min(server_count, 7)))  # a queue has at most 7 replicas
    names = [f"s{number}" for number in range(server_count)]
    queues = [QueueEntry(f"q{number}", {"replicas": replicas}) for number in range(queue_count)]
    placement = place_queues(queues, names)
    led = collections.Counter(shards[0][0] for shards in placement.values())
    hosted = collections.Counter(server for shards in placement.values() for server in shards[0])
    assert max(led[name] for name in names) - min(led[name] for name in names) <= 1
    assert max(hosted[name] for name in names) - min(hosted[name] for name in names) <= 1


def test_queues_placed_together_spread_their_leaders_after_the_queues_already_placed() -> None:
    queues = [QueueEntry("wide", {"shards": 4}), QueueEntry("a", {}), QueueEntry("b", {}), QueueEntry("c", {})]
    placed = {"old": [["s3"]]}
    placement = place_queues(queues, ["s1", "s2", "s3"], placed=placed)
    # wide's four shards go where old's one leader is not doubled (s1 twice, s2, s3), then
    # a, b and c each lead where fewest are led: s2, s1, s2.
    led = [replicas[0] for shards in [*placement.values(), *placed.values()] for replicas in shards]
    assert [replicas[0] for replicas in placement["wide"]] == ["s1", "s1", "s2", "s3"]
    assert [placement[name] for name in "abc"] == [[["s2"]], [["s1"]], [["s2"]]]
    assert sorted(led) == ["s1"] * 3 + ["s2"] * 3 + ["s3"] * 2
    assert placement == place_queues(queues, ["s3", "s2", "s1"], placed=placed)  # order of the facts is no matter


def test_a_dead_letter_queue_in_use_is_not_removed() -> None:
    cluster = sample_map()
    with_dlq = with_queue_changed(
        cluster,
        QueueEntry("orders", {"shards": 4, "replicas": 3, "dead_letter_queue": "orders-dlq", "max_receive_count": 3}),
    )
    with pytest.raises(ValueError, match="dead-letter queue of orders"):
        with_queue_removed(with_dlq, "orders-dlq")
    without = with_queue_removed(cluster, "orders-dlq")
    assert [queue.name for queue in without.queues] == ["orders"]
    assert "orders-dlq" not in without.placement
    with pytest.raises(ValueError, match="not in the cluster map"):
        with_queue_removed(without, "orders-dlq")


@pytest.mark.parametrize(("setting", "value"), [("shards", 8), ("fifo", True), ("replicas", 2)])
def test_settings_fixed_at_creation_cannot_change(setting: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{setting} cannot change"):
        with_queue_changed(sample_map(), QueueEntry("orders", {"shards": 4, "replicas": 3, setting: value}))


def test_the_change_between_two_maps_names_what_a_server_must_do() -> None:
    old = sample_map()
    new = with_queue_added(with_queue_removed(old, "orders-dlq"), QueueEntry("audit", {}))
    new = with_queue_changed(new, QueueEntry("orders", {"shards": 4, "replicas": 3, "visibility_timeout": "45s"}))
    change = change_between(old, new)
    assert [queue.name for queue in change.added] == ["audit"]
    assert change.removed == ["orders-dlq"]
    assert [queue.name for queue in change.changed] == ["orders"]
    assert change.refused == {}
    assert change_between(new, new).empty


def test_a_change_a_running_server_cannot_make_is_refused_with_its_reason() -> None:
    old = sample_map()
    data = json.loads(cluster_map_to_text(old))
    data["queues"][0]["spec"]["shards"] = 2
    data["placement"]["orders"] = data["placement"]["orders"][:2]
    # Built directly: the parser already refuses such a map.
    short = dataclasses.replace(old, placement={**old.placement, "orders": old.placement["orders"][:2]})
    assert change_between(old, cluster_map_from_text(json.dumps(data))).refused == {
        "orders": "shards cannot change on a running queue"
    }
    assert change_between(old, short).refused == {"orders": "its placement lists 2 shards where it had 4"}


def test_replicas_added_or_removed_are_a_move_the_servers_apply() -> None:
    old = sample_map()
    moved = json.loads(cluster_map_to_text(old))
    moved["placement"]["orders"][0] = list(reversed(moved["placement"]["orders"][0]))
    moved["queues"][0]["spec"]["visibility_timeout"] = "45s"
    change = change_between(old, cluster_map_from_text(json.dumps(moved)))
    assert change.moved == ["orders"]
    assert [queue.name for queue in change.changed] == ["orders"]
    assert change.refused == {}
    assert not change.empty


def test_a_queue_made_again_under_its_name_is_removed_and_added() -> None:
    old = sample_map()
    first = dataclasses.replace(old, queues=[dataclasses.replace(q, uid=f"{q.name}-1") for q in old.queues])
    again = dataclasses.replace(
        first, queues=[dataclasses.replace(q, uid="orders-2") if q.name == "orders" else q for q in first.queues]
    )
    change = change_between(first, again)
    assert [queue.name for queue in change.added] == ["orders"]
    assert change.added[0].uid == "orders-2"
    assert change.removed == ["orders"]
    assert change.changed == []
    assert change.moved == []
    # The uid goes through the map's text, and a map naming none (written before uids) parses.
    assert cluster_map_from_text(cluster_map_to_text(again)) == again
    assert "uid" not in cluster_map_to_text(old)


def test_a_map_first_naming_a_queues_uid_is_no_change_and_a_settings_change_keeps_it() -> None:
    old = sample_map()
    named = dataclasses.replace(old, queues=[dataclasses.replace(q, uid="u-1") for q in old.queues])
    assert change_between(old, named).empty
    changed = with_queue_changed(named, QueueEntry("orders", {"shards": 4, "replicas": 3, "visibility_timeout": "9s"}))
    assert next(q for q in changed.queues if q.name == "orders").uid == "u-1"
    assert [queue.name for queue in change_between(named, changed).changed] == ["orders"]
