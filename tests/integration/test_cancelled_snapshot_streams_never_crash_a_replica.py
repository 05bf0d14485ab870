"""Follower-bootstrap snapshots and exports, abandoned at every point, never crash a replica.

A snapshot copies the leader's LMDB environment in a worker thread and streams
the copy; the requester may vanish before, during or after the copy. Exports run
on the leader beside the snapshots; a follower refuses them (NOT_LEADER, naming
the leader) without disturbing what it applies.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import export_pb2, export_pb2_grpc, replication_pb2, replication_pb2_grpc
from shardq.errors import Reason
from shardq.status import error_from_rpc
from tests.support.clusters import SERVERS, Cluster
from tests.support.servers import wait_for

MESSAGES = 3_000
BODY = b"s" * 1_000
CANCEL_AFTER_CHUNKS = (0, 1, 2)
ROUNDS = 5


def fill(cluster: Cluster) -> int:
    with Client(cluster.endpoint("s1")) as client:

        def first_accepted() -> int | None:
            try:
                return len(client.send_messages("orders", [Message(BODY + b"first")]))
            except Exception:  # leadership settling at startup: try again
                return None

        sent = wait_for(first_accepted, timeout=60, interval=0.5, what="the cluster to accept sends")
        while sent < MESSAGES:
            sent += len(client.send_messages("orders", [Message(BODY + b"%d" % (sent + i)) for i in range(100)]))
    return sent


async def abandon_snapshot(endpoint: str, chunks: int) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = replication_pb2_grpc.ReplicationServiceStub(channel)
        call = stub.Snapshot(replication_pb2.SnapshotRequest(queue="orders", shard=0, requester_id="s2"))
        read = 0
        async for _ in call:
            if read >= chunks:
                break
            read += 1
        call.cancel()


async def abandon_export(endpoint: str, batches: int) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        call = stub.ExportMessages(
            export_pb2.ExportMessagesRequest(queue="orders", shard=0, batch_size=500, include_body=True)
        )
        read = 0
        async for _ in call:
            if read >= batches:
                break
            read += 1
        call.cancel()


async def abandon_everything(cluster: Cluster) -> None:
    leader = cluster.leader_of(0).holder
    follower = next(server for server in SERVERS if server != leader)
    for _ in range(ROUNDS):
        for chunks in CANCEL_AFTER_CHUNKS:
            await asyncio.gather(
                abandon_snapshot(cluster.endpoint(leader), chunks),
                abandon_export(cluster.endpoint(leader), chunks),
                refused_follower_export(cluster.endpoint(follower), cluster.endpoint(leader)),
            )


async def refused_follower_export(endpoint: str, leader: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        call = stub.ExportMessages(export_pb2.ExportMessagesRequest(queue="orders", shard=0, batch_size=500))
        with pytest.raises(grpc.RpcError) as refused:
            async for _ in call:
                pass
        error = error_from_rpc(refused.value, queue="orders")
        assert error.reason is Reason.NOT_LEADER, error
        assert error.leader == leader


@pytest.mark.timeout(180)
def test_abandoned_snapshots_and_follower_exports_leave_every_replica_serving(cluster: Cluster) -> None:
    sent = fill(cluster)
    asyncio.run(abandon_everything(cluster))

    for server in SERVERS:
        process = cluster.processes[server]
        assert process.poll() is None, f"{server} died with {process.returncode}"
        assert "Fatal Python error" not in (cluster.root / f"{server}.log").read_text(errors="replace")
    with Client(cluster.endpoint("s1")) as client:
        attributes = client.attributes("orders")
        assert attributes.visible + attributes.in_flight + attributes.delayed == sent
