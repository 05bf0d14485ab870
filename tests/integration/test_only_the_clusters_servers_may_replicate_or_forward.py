"""Replication calls, and calls marked as forwarded, are taken only from the cluster's servers.

Before the peer secret a server took any caller for a peer: a client could append entries
to a follower's log by naming the current epoch and its lease holder (the fencing checks
who the lease names, not who calls), stream a whole shard out through Snapshot by naming
a replica, or set the reserved `shardq.*` attributes by marking its send as forwarded.
Now each is refused with UNAUTHENTICATED and reason NOT_A_PEER, before it is
acted on, while the servers, which hold the secret, replicate and forward as before.

Real servers, each started with `--peer-secret-file`: s1 leads shard 0, s2 and s3 copy it,
and s4 holds no copy and forwards.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from shard_server.runtime.forwarding import FORWARDED_HEADER
from shardq.api.v1 import queue_pb2, queue_pb2_grpc, replication_pb2, replication_pb2_grpc
from shardq.coordination.fencing import isr_of
from shardq.coordination.peer_credentials import PEER_SECRET_HEADER, new_peer_secret, write_peer_secret
from shardq.errors import ERROR_DOMAIN
from tests.support.clusters import Cluster, every_shard_led, running
from tests.support.servers import wait_for

QUEUE = "orders"
SHARD = 0
NOT_THE_SECRET = "x" * 43


@pytest.fixture
def secret(tmp_path: pathlib.Path) -> str:
    value = new_peer_secret()
    write_peer_secret(tmp_path / "peer-secret", value)
    return value


@pytest.fixture
def cluster(tmp_path: pathlib.Path, secret: str) -> Iterator[Cluster]:
    yield from running(
        Cluster(
            tmp_path / "cluster",
            lease_ms=60_000,
            spare_servers=("s4",),
            server_args=("--peer-secret-file", str(tmp_path / "peer-secret")),
        )
    )


def refusal(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and the ErrorInfo reason of a refused call."""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            info = error_details_pb2.ErrorInfo()
            assert status_pb2.Status.FromString(value).details[0].Unpack(info)
            assert info.domain == ERROR_DOMAIN
            return error.code(), info.reason  # type: ignore[attr-defined]
    raise AssertionError(f"no ErrorInfo in {error}")


def shard_status(stub: replication_pb2_grpc.ReplicationServiceStub, secret: str) -> replication_pb2.ReplicaStatus:
    answer = stub.GetReplicaStatus(
        replication_pb2.GetReplicaStatusRequest(), metadata=((PEER_SECRET_HEADER, secret),), timeout=5
    )
    (status,) = [replica for replica in answer.replicas if replica.queue == QUEUE and replica.shard == SHARD]
    return status


def bodies(stub: queue_pb2_grpc.QueueServiceStub) -> list[bytes]:
    request = queue_pb2.ReceiveMessagesRequest(queue=QUEUE, shard=SHARD, max_messages=100, peek=True)
    return sorted(message.body for message in stub.ReceiveMessages(request, timeout=10).messages)


def send_one(stub: queue_pb2_grpc.QueueServiceStub, body: bytes) -> queue_pb2.SendMessagesResponse:
    request = queue_pb2.SendMessagesRequest(queue=QUEUE, shard=SHARD, messages=[queue_pb2.MessageToSend(body=body)])
    return stub.SendMessages(request, timeout=30)


# What a server moving a dead letter to a DLQ led elsewhere may set, and a client may not.
FORGED = queue_pb2.SendMessagesRequest(
    queue=QUEUE,
    shard=SHARD,
    messages=[queue_pb2.MessageToSend(body=b"forged", attributes={"shardq.dead-letter-source": "forged"})],
)


@pytest.mark.timeout(120)
def test_servers_with_the_secret_replicate_and_forward_and_nobody_else_may(cluster: Cluster, secret: str) -> None:
    with (
        grpc.insecure_channel(cluster.endpoint("s4")) as forwarder,
        grpc.insecure_channel(cluster.endpoint("s1")) as leader,
        grpc.insecure_channel(cluster.endpoint("s2")) as follower,
    ):
        through_s4 = queue_pb2_grpc.QueueServiceStub(forwarder)
        wait_for(lambda: every_shard_led(through_s4, shards=2), timeout=30, what="every shard led")
        # s4 forwards to s1 with the secret, and s1 replicates to s2 and s3 with it.
        assert send_one(through_s4, b"kept").results[0].message_id
        wait_for(lambda: len(isr_of(cluster.leader_of(SHARD))) == 3, timeout=10, what="all three in sync")
        replication = replication_pb2_grpc.ReplicationServiceStub(follower)
        before = shard_status(replication, secret)
        assert before.last_index >= 1  # copied (its commit index follows with the next heartbeat)

        for metadata in [(), ((PEER_SECRET_HEADER, NOT_THE_SECRET),), ((PEER_SECRET_HEADER, secret[:-1]),)]:
            # Passes the fencing: the epoch and the leader are the ones the lease names.
            hostile = replication_pb2.AppendRequest(
                queue=QUEUE,
                shard=SHARD,
                epoch=before.epoch,
                leader_id="s1",
                prev_index=before.last_index,
                prev_epoch=before.epoch,
                entries=[b"not an entry"],
                commit_index=before.last_index + 1,
            )
            with pytest.raises(grpc.RpcError) as appended:
                replication.Append(hostile, metadata=metadata, timeout=5)
            assert refusal(appended.value) == (grpc.StatusCode.UNAUTHENTICATED, "NOT_A_PEER")

            snapshot = replication_pb2.SnapshotRequest(queue=QUEUE, shard=SHARD, requester_id="s3")
            with pytest.raises(grpc.RpcError) as copied:
                list(replication.Snapshot(snapshot, metadata=metadata, timeout=5))
            assert refusal(copied.value) == (grpc.StatusCode.UNAUTHENTICATED, "NOT_A_PEER")

            with pytest.raises(grpc.RpcError) as asked:
                replication.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), metadata=metadata, timeout=5)
            assert refusal(asked.value) == (grpc.StatusCode.UNAUTHENTICATED, "NOT_A_PEER")

            # A send marked as forwarded may set reserved attributes: not from a client.
            marked = ((FORWARDED_HEADER, "1"), *metadata)
            with pytest.raises(grpc.RpcError) as forged:
                queue_pb2_grpc.QueueServiceStub(leader).SendMessages(FORGED, metadata=marked, timeout=30)
            assert refusal(forged.value) == (grpc.StatusCode.UNAUTHENTICATED, "NOT_A_PEER")

        after = shard_status(replication, secret)
        assert (after.epoch, after.last_index) == (before.epoch, before.last_index)
        assert after.role == replication_pb2.REPLICA_ROLE_FOLLOWER
        # The shard still replicates: a plain send is stored and copied.
        assert send_one(through_s4, b"after").results[0].message_id
        wait_for(lambda: shard_status(replication, secret).last_index > before.last_index, timeout=10, what="copied")
        assert bodies(queue_pb2_grpc.QueueServiceStub(leader)) == [b"after", b"kept"]
        # What decides is the secret alone: with it, the marked send is a server's, and taken.
        marked = ((FORWARDED_HEADER, "1"), (PEER_SECRET_HEADER, secret))
        taken = queue_pb2_grpc.QueueServiceStub(leader).SendMessages(FORGED, metadata=marked, timeout=30)
        assert taken.results[0].message_id
        assert bodies(queue_pb2_grpc.QueueServiceStub(leader)) == [b"after", b"forged", b"kept"]
        assert len(isr_of(cluster.leader_of(SHARD))) == 3


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (None, "cannot read the peer secret"),
        ("short", "at least 32 characters, this one 5"),
        ("with a space in it and long enough to pass the length", "without spaces"),
    ],
)
def test_a_server_refuses_to_start_with_a_peer_secret_it_cannot_use(
    tmp_path: pathlib.Path, content: str | None, complaint: str
) -> None:
    path = tmp_path / "peer-secret"
    if content is not None:
        path.write_text(content)
    command = [
        sys.executable, "-m", "shardq", "serve", "--data-dir", str(tmp_path / "data"),
        "--queue", "orders", "--port", "0", "--peer-secret-file", str(path),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode != 0
    assert complaint in finished.stderr
    assert str(path) in finished.stderr
    if content is not None:
        assert content not in finished.stderr  # the secret is never quoted
