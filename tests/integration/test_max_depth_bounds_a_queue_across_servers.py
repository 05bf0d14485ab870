"""maxDepth is a queue's bound, not a server's: a leader counts the shards led elsewhere
as their leaders report them. Real servers of a three-server cluster."""

from __future__ import annotations

import contextlib
import pathlib
import time

import grpc
import pytest

from shard_server.runtime.hosting import REMOTE_DEPTH_REFRESH_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import wait_for

QUEUE = "orders"


@pytest.mark.timeout(120)
def test_a_leader_counts_the_shards_led_elsewhere_against_max_depth(tmp_path: pathlib.Path) -> None:
    """maxDepth bounds the queue across servers: s2's shard holds 8 of the 10 the queue
    may, and a batch of 2 through s1 to its own shard (1 there) is refused, s1 having
    counted s2's shard as s2 reported it (at most REMOTE_DEPTH_REFRESH_S before)."""
    # Shards 0, 1 and 2 led by s1, s2 and s3.
    bounded = Cluster(tmp_path / "cluster", placement=THREE_LEADERS, spec={"max_depth": 10})
    with (
        contextlib.contextmanager(running)(bounded) as cluster,
        grpc.insecure_channel(cluster.endpoint("s1")) as channel,
    ):
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")

        def send(shard: int, count: int) -> queue_pb2.SendMessagesResponse:
            request = queue_pb2.SendMessagesRequest(
                queue=QUEUE, shard=shard, messages=[queue_pb2.MessageToSend(body=b"m")] * count
            )
            return stub.SendMessages(request, timeout=10)

        assert all(result.message_id for result in send(1, 8).results)  # forwarded to s2
        time.sleep(REMOTE_DEPTH_REFRESH_S)
        assert send(0, 1).results[0].message_id  # asks s2 for its depth
        time.sleep(REMOTE_DEPTH_REFRESH_S)
        with pytest.raises(grpc.RpcError) as refused:
            send(0, 2)
        assert "max depth" in (refused.value.details() or "")
