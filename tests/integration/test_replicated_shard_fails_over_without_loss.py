"""Three real servers replicate a queue; its leader is SIGKILLed and its lease taken
over by an in-sync follower (as the supervisor or operator would): nothing
acknowledged is lost, nothing deleted comes back, and the fenced epoch's
replication requests, like a non-peer's, are refused."""

from __future__ import annotations

import time
import zlib

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.fencing import build_takeover, is_expired, isr_of
from shardq.coordination.leases import LeaseRecord
from tests.support.clusters import LEASE_MS, Cluster, send_until_accepted
from tests.support.servers import wait_for


def drain(client: Client) -> dict[bytes, str]:
    seen: dict[bytes, str] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        messages = client.receive_messages("orders", max_messages=100, wait_time_ms=500)
        if not messages:
            attributes = client.attributes("orders")
            # A shard whose leader did not answer is left out of the counts: not empty yet.
            if attributes.complete and attributes.visible + attributes.in_flight + attributes.delayed == 0:
                return seen
            continue
        for message in messages:
            seen[message.body] = message.message_id
        client.delete_messages("orders", [m.receipt for m in messages])
    raise AssertionError("the queue did not drain in time")


@pytest.mark.timeout(120)
def test_replicated_shard_fails_over_without_loss(cluster: Cluster) -> None:
    fail_over_and_check(cluster)


@pytest.mark.controlplane
@pytest.mark.timeout(120)
def test_replicated_shard_fails_over_without_loss_on_kubernetes_leases(kubernetes_cluster: Cluster) -> None:
    fail_over_and_check(kubernetes_cluster)


def fail_over_and_check(cluster: Cluster) -> None:
    # One client throughout: its shard map goes stale at the failover and must refresh.
    with Client(cluster.endpoint("s3")) as client:
        first = [f"before-{i}".encode() for i in range(60)]
        for start in range(0, len(first), 10):  # batches spread round-robin over both shards
            send_until_accepted(client, first[start : start + 10], shard_hint="startup")
        received = client.receive_messages("orders", max_messages=15, wait_time_ms=2_000)
        assert received, "nothing was received before the failover"
        deleted = {m.body for m in received if all(r.ok for r in client.delete_messages("orders", [m.receipt]))}
        assert deleted, "no delete was acknowledged"

        old = cluster.leader_of(0)
        assert old.holder == "s1"
        cluster.kill("s1")

        def expired_lease() -> LeaseRecord | None:
            lease = cluster.leader_of(0)
            return lease if is_expired(lease, int(time.time() * 1000)) else None

        expired = wait_for(expired_lease, timeout=20, what="the dead leader's lease to expire")
        candidate = sorted(isr_of(expired) - {"s1"})[0]
        cluster.leases.update(
            build_takeover(expired, new_holder=candidate, now_ms=int(time.time() * 1000), duration_ms=cluster.lease_ms)
        )

        after = [f"after-{i}".encode() for i in range(20)]
        for start in range(0, len(after), 10):
            send_until_accepted(client, after[start : start + 10], shard_hint="after failover")
        # Those may all have gone to shard 1: a send any shard may take is stored on a led
        # one rather than wait for shard 0's new leader. Sends whose dedup ids choose shard
        # 0 can only be stored by its new leader, which the client must find.
        on_shard_0 = [f"after-keyed-{i}" for i in range(40) if zlib.crc32(f"after-keyed-{i}".encode()) % 2 == 0][:5]
        keyed = client.send_messages("orders", [Message(key.encode(), dedup_id=key) for key in on_shard_0])
        assert [(result.error_reason, result.shard) for result in keyed] == [("", 0)] * len(on_shard_0)
        after += [key.encode() for key in on_shard_0]
        routes = client.describe("orders")
        assert routes[0].leader_address == cluster.endpoint(candidate)
        assert routes[0].epoch == old.transitions + 1
        stored = drain(client)

    expected = (set(first) - deleted) | set(after)
    assert set(stored) == expected, (
        f"lost {sorted(expected - set(stored))[:5]}, resurrected {sorted(set(stored) - expected)[:5]}"
    )


@pytest.mark.timeout(60)
def test_replication_requests_from_non_peers_or_fenced_epochs_are_refused(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1")) as client:
        send_until_accepted(client, [b"x"], shard_hint="startup")
    channel = grpc.insecure_channel(cluster.endpoint("s2"))
    stub = replication_pb2_grpc.ReplicationServiceStub(channel)
    try:
        forged = stub.Append(
            replication_pb2.AppendRequest(queue="orders", shard=0, epoch=99, leader_id="intruder", commit_index=1),
            timeout=5,
        )
        assert forged.outcome == replication_pb2.APPEND_OUTCOME_REFUSED
        # A peer that is a replica but not the lease holder at that epoch.
        impostor = stub.Append(
            replication_pb2.AppendRequest(queue="orders", shard=0, epoch=1, leader_id="s3", commit_index=1),
            timeout=5,
        )
        assert impostor.outcome == replication_pb2.APPEND_OUTCOME_REFUSED
        # Epoch 2 is taken over by s3; a replay of s1's epoch-1 traffic is then fenced.
        lease = cluster.leader_of(0)
        cluster.leases.update(
            build_takeover(lease, new_holder="s3", now_ms=int(time.time() * 1000), duration_ms=LEASE_MS)
        )

        def raised_to_epoch_2() -> bool | None:
            status = stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=5)
            return next((True for r in status.replicas if r.shard == 0 and r.epoch >= 2), None)

        wait_for(raised_to_epoch_2, timeout=15, what="the follower to see epoch 2")
        replay = stub.Append(
            replication_pb2.AppendRequest(queue="orders", shard=0, epoch=1, leader_id="s1", commit_index=1),
            timeout=5,
        )
        assert replay.outcome == replication_pb2.APPEND_OUTCOME_STALE_EPOCH
        assert replay.epoch >= 2
    finally:
        channel.close()


@pytest.mark.timeout(90)
def test_an_epoch_the_lease_does_not_name_moves_no_leader_and_no_follower(cluster: Cluster) -> None:
    """Any client reaches the replication service (peers are not authenticated yet). An
    Append naming a replica at an epoch of 2**63 once made the leader step down, and a
    follower record that epoch and then refuse its real leader as stale; entries that
    were not log entries failed as UNKNOWN with a Python exception's text."""
    with Client(cluster.endpoint("s1")) as client:
        send_until_accepted(client, [b"before"], shard_hint="startup")
    before = cluster.leader_of(0)
    assert before.holder == "s1"

    def status_of(server: str) -> replication_pb2.ReplicaStatus:
        with grpc.insecure_channel(cluster.endpoint(server)) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            listed = stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=5)
        return next(r for r in listed.replicas if r.queue == "orders" and r.shard == 0)

    def append(server: str, request: replication_pb2.AppendRequest) -> replication_pb2.AppendResponse:
        with grpc.insecure_channel(cluster.endpoint(server)) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            response: replication_pb2.AppendResponse = stub.Append(request, timeout=5)
        return response

    forged_epoch = 2**63
    to_leader = append("s1", replication_pb2.AppendRequest(queue="orders", shard=0, epoch=forged_epoch, leader_id="s2"))
    to_follower = append(
        "s2", replication_pb2.AppendRequest(queue="orders", shard=0, epoch=forged_epoch, leader_id="s3")
    )
    for response in (to_leader, to_follower):
        assert response.outcome == replication_pb2.APPEND_OUTCOME_REFUSED
        assert f"at epoch {forged_epoch}" in response.detail
    garbage = append(
        "s2",
        replication_pb2.AppendRequest(
            queue="orders", shard=0, epoch=before.transitions, leader_id="s1", entries=[b"garbage"]
        ),
    )
    assert garbage.outcome == replication_pb2.APPEND_OUTCOME_REFUSED
    assert garbage.detail.startswith("not a log entry")

    assert status_of("s1").role == replication_pb2.REPLICA_ROLE_LEADER
    for server in ("s1", "s2"):
        assert status_of(server).epoch == before.transitions, f"{server} took the forged epoch"
    after = cluster.leader_of(0)
    assert (after.holder, after.transitions) == ("s1", before.transitions)
    # The real leader still replicates to the follower the forgeries were sent to.
    with Client(cluster.endpoint("s1")) as client:
        send_until_accepted(client, [b"after"], shard_hint="after the forgeries")
    wait_for(
        lambda: status_of("s2").commit_index >= status_of("s1").commit_index or None,
        timeout=10,
        what="the follower to hold what the leader committed",
    )
