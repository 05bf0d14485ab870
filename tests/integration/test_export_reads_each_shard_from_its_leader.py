"""In a cluster, a shard is exported by its leader only: a server that holds no replica of
it, or only a follower's, answers NOT_LEADER naming the leader, and the Spark source's
connection follows that hint. (Before, a server indexed its local shards by position,
so a server holding shards 1 and 3 exported shard 3 when asked for shard 1.)"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.errors import Reason
from shardq.spark.exporting import ExportConnection
from shardq.status import error_from_rpc
from tests.support.clusters import Cluster, running
from tests.support.servers import wait_for

# Shard 0 on s1 and s2 (s1 leads), shard 1 on s2 and s3 (s2 leads): s1 holds no copy of shard 1.
PLACEMENT = [["s1", "s2"], ["s2", "s3"]]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


@pytest.mark.timeout(90)
def test_each_shard_is_exported_by_its_leader_wherever_the_reader_connects(cluster: Cluster) -> None:
    sent: dict[int, set[bytes]] = {0: set(), 1: set()}
    with Client(cluster.endpoint("s1"), route_directly=False) as client:

        def sent_to_both_shards() -> bool:
            body = f"m{len(sent[0]) + len(sent[1])}".encode()
            try:
                (result,) = client.send_messages("orders", [Message(body)])
            except Exception:  # leaders still starting
                return False
            if result.ok:
                sent[result.shard].add(body)
            return len(sent[0]) >= 5 and len(sent[1]) >= 5

        wait_for(sent_to_both_shards, timeout=30, interval=0.05, what="messages on both shards")

    # A follower's copy, or no copy at all: NOT_LEADER naming shard 1's leader, s2.
    for server in ("s1", "s3"):
        with grpc.insecure_channel(cluster.endpoint(server)) as channel:
            stub = export_pb2_grpc.ExportServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ExportMessages(export_pb2.ExportMessagesRequest(queue="orders", shard=1), timeout=5))
            error = error_from_rpc(refused.value, queue="orders")
            assert error.reason is Reason.NOT_LEADER, error
            assert error.leader == cluster.endpoint("s2")

    with ExportConnection(cluster.endpoint("s1"), rpc_timeout_seconds=5) as connection:
        assert connection.shard_count("orders") == 2
        for shard in (0, 1):
            exported = {
                message.body
                for batch in connection.message_batches(queue="orders", shard=shard, include_body=True, batch_size=100)
                for message in batch.messages
            }
            assert exported == sent[shard], f"shard {shard}"
            bounds = connection.journal_bounds("orders", shard)
            assert bounds.last_index >= len(sent[shard])
