"""A queue deleted and made again under its name never serves the old one's messages,
even from a volume that kept them.

Kubernetes retains a StatefulSet's volumes (`retainOnDelete`, scale-in), and a cluster
deleted and made again starts its Leases again at epoch 1. A server that kept the old
queue's log would then match the new leader's first entries by index and epoch, keep its
own messages under them, and serve them once it leads: acknowledged sends lost, deleted
messages back. The map names which creation of the queue it means (its uid); a server
holding another creation's data discards it before it joins. Real servers, a real
retained data directory, a real lease takeover."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import time

import pytest

from shard_server.runtime.map_following import ClusterMapFile
from shard_server.storage.queue_directories import held_uid
from shardq import Client, Message, ShardqError
from shardq.coordination.cluster_map import write_cluster_map
from shardq.coordination.fencing import build_takeover, incarnations_of, is_expired
from shardq.coordination.leases import LeaseRecord
from tests.support.clusters import LEASE_MS, Cluster, running
from tests.support.servers import wait_for

PAIR = [["s1", "s2"]]
started = contextlib.contextmanager(running)


def send_all(cluster: Cluster, bodies: list[bytes]) -> None:
    with Client(cluster.endpoint("s1")) as client:

        def attempt() -> bool | None:
            try:
                return all(r.ok for r in client.send_messages("orders", [Message(b) for b in bodies])) or None
            except ShardqError:
                return None  # the servers are still starting

        wait_for(attempt, timeout=30, what="the batch to be acknowledged")


@pytest.mark.timeout(120)
def test_a_queue_made_again_never_serves_its_namesakes_data(tmp_path: pathlib.Path) -> None:
    old = Cluster(tmp_path / "old", placement=PAIR, uid="creation-1")
    with started(old):
        send_all(old, [f"old-{i}".encode() for i in range(5)])
        # Acknowledged sends are on every in-sync replica: s2's volume holds them.
        wait_for(lambda: incarnations_of(old.leader_of(0)).get("s2"), timeout=10, what="s2 in sync")

    # The queue and its cluster are made again; s2's volume was retained.
    new = Cluster(tmp_path / "new", placement=PAIR, uid="creation-2")
    assert new.leader_of(0).transitions <= old.leader_of(0).transitions  # the epochs start again
    shutil.copytree(tmp_path / "old" / "s2", tmp_path / "new" / "s2")
    with started(new):
        fresh = [f"new-{i}".encode() for i in range(3)]
        send_all(new, fresh)
        wait_for(lambda: incarnations_of(new.leader_of(0)).get("s2"), timeout=10, what="s2 in sync")
        new.kill("s1")

        def expired_lease() -> LeaseRecord | None:
            lease = new.leader_of(0)
            return lease if is_expired(lease, int(time.time() * 1000)) else None

        lease = wait_for(expired_lease, timeout=10, what="the dead leader's lease to expire")
        new.leases.update(build_takeover(lease, new_holder="s2", now_ms=int(time.time() * 1000), duration_ms=LEASE_MS))
        with Client(new.endpoint("s2")) as client:

            def received() -> list[bytes] | None:
                try:
                    got = client.receive_messages("orders", max_messages=10, wait_time_ms=1000)
                except ShardqError:
                    return None  # s2 is still taking the lead
                return sorted(m.body for m in got) or None

            bodies = wait_for(received, timeout=30, what="s2 to serve the queue")
        assert bodies == fresh
    log = (tmp_path / "new" / "s2.log").read_text()
    assert "that queue was deleted, so its data here is deleted too" in log


@pytest.mark.timeout(120)
def test_running_servers_drop_a_namesakes_data_when_the_map_names_another_creation(tmp_path: pathlib.Path) -> None:
    """The map changes while the servers run (the queue deleted and made again between
    two reads of it): each server deletes the old creation's data and opens the new one
    empty, and it takes sends at once."""
    cluster = Cluster(tmp_path, placement=PAIR, uid="creation-1")
    with started(cluster):
        send_all(cluster, [f"old-{i}".encode() for i in range(5)])
        # As a local cluster's servers change the map: under its lock, the new creation's
        # leases made first (next epoch, empty replicas in sync, no data vouched for).
        ClusterMapFile(cluster.cluster_file, cluster.leases, now_ms=lambda: int(time.time() * 1000)).change(
            lambda current: dataclasses.replace(
                current, queues=[dataclasses.replace(current.queues[0], uid="creation-2")]
            )
        )
        for server in PAIR[0]:
            wait_for(
                lambda server=server: held_uid(tmp_path / server / "queues" / "orders") == "creation-2" or None,
                timeout=15,
                what=f"{server} to hold the new creation",
            )
        fresh = [f"new-{i}".encode() for i in range(3)]
        send_all(cluster, fresh)
        with Client(cluster.endpoint("s1")) as client:
            got = client.receive_messages("orders", max_messages=10, wait_time_ms=1000)
        assert sorted(m.body for m in got) == fresh


@pytest.mark.timeout(120)
def test_servers_record_a_uid_the_map_names_for_the_first_time(tmp_path: pathlib.Path) -> None:
    """A map written before uids names one later (the operator upgraded): running servers
    record it beside the data they hold, which stays, so that a namesake made after a
    deletion they miss is told apart even if they never restart."""
    cluster = Cluster(tmp_path, placement=PAIR)
    with started(cluster):
        kept = [f"kept-{i}".encode() for i in range(3)]
        send_all(cluster, kept)
        assert held_uid(tmp_path / "s1" / "queues" / "orders") == ""
        named = dataclasses.replace(
            cluster.cluster_map, queues=[dataclasses.replace(cluster.cluster_map.queues[0], uid="creation-1")]
        )
        write_cluster_map(cluster.cluster_file, named)
        for server in PAIR[0]:
            wait_for(
                lambda server=server: held_uid(tmp_path / server / "queues" / "orders") == "creation-1" or None,
                timeout=15,
                what=f"{server} to record the uid",
            )
        with Client(cluster.endpoint("s1")) as client:
            got = client.receive_messages("orders", max_messages=10, wait_time_ms=1000)
        assert sorted(m.body for m in got) == kept
