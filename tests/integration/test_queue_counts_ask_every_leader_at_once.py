"""A queue's counts through one server ask the other leaders all at once: two hung
leaders (SIGSTOPped) cost the call one deadline, and the answer still carries the
shards led by the server asked. One after another, each hung leader cost its own 10 s,
so the call outlived a 15 s client deadline."""

from __future__ import annotations

import os
import pathlib
import signal
from collections.abc import Iterator

import grpc
import pytest

from shard_server.service.queues import REMOTE_COUNTS_WITHIN_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.clusters import Cluster, running
from tests.support.servers import wait_for

# Three shards, each led by its placement's first server: s1, s2, s3.
PLACEMENT = [["s1", "s2"], ["s2", "s3"], ["s3", "s1"]]
DEADLINE_S = 1.5 * REMOTE_COUNTS_WITHIN_S


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


def counted_shards(stub: queue_pb2_grpc.QueueServiceStub) -> list[int]:
    attributes = stub.GetQueueAttributes(queue_pb2.GetQueueAttributesRequest(queue="orders"), timeout=DEADLINE_S)
    return [shard.shard for shard in attributes.shards]


def every_shard_counted(stub: queue_pb2_grpc.QueueServiceStub) -> bool:
    try:
        return counted_shards(stub) == [0, 1, 2]
    except grpc.RpcError:  # still starting
        return False


@pytest.mark.timeout(120)
def test_two_hung_leaders_cost_the_counts_one_deadline(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_counted(stub), timeout=30, what="every shard led and counted")
        hung = [cluster.processes[server].pid for server in ("s2", "s3")]
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        try:
            shards = counted_shards(stub)  # DEADLINE_EXCEEDED if the leaders are asked in turn
        finally:
            for pid in hung:
                os.kill(pid, signal.SIGCONT)
        assert shards == [0], "the shard led by the server asked must be counted, the hung leaders' left out"
        # Back: every leader answers again.
        wait_for(lambda: every_shard_counted(stub), timeout=30, what="the resumed leaders counted")
