"""maxDepth is a queue's bound, not a server's: a leader counts the shards led elsewhere
as their leaders report them. Real servers of a three-server cluster."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from shard_server.runtime.hosting import REMOTE_DEPTH_REFRESH_S, REMOTE_DEPTH_WITHIN_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import wait_for

QUEUE = "orders"
Send = Callable[[int, int], queue_pb2.SendMessagesResponse]


@contextlib.contextmanager
def bounded_through_s1(cluster: Cluster, *, deadline_s: float) -> Iterator[tuple[Cluster, Send]]:
    """The running cluster, once every shard is led, and a send of `count` messages to a
    shard through s1 with a deadline of `deadline_s`."""
    with (
        contextlib.contextmanager(running)(cluster) as started,
        grpc.insecure_channel(started.endpoint("s1")) as channel,
    ):
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")

        def send(shard: int, count: int) -> queue_pb2.SendMessagesResponse:
            request = queue_pb2.SendMessagesRequest(
                queue=QUEUE, shard=shard, messages=[queue_pb2.MessageToSend(body=b"m")] * count
            )
            return stub.SendMessages(request, timeout=deadline_s)

        yield started, send


@pytest.mark.timeout(120)
def test_a_leader_counts_the_shards_led_elsewhere_against_max_depth(tmp_path: pathlib.Path) -> None:
    """maxDepth bounds the queue across servers: s2's shard holds 8 of the 10 the queue
    may, and a batch of 2 through s1 to its own shard (1 there) is refused, s1 having
    counted s2's shard as s2 last reported it."""
    # Shards 0, 1 and 2 led by s1, s2 and s3.
    bounded = Cluster(tmp_path / "cluster", placement=THREE_LEADERS, spec={"max_depth": 10})
    with bounded_through_s1(bounded, deadline_s=10) as (_, send):
        assert all(result.message_id for result in send(1, 8).results)  # forwarded to s2
        time.sleep(REMOTE_DEPTH_REFRESH_S)
        assert send(0, 1).results[0].message_id  # s1's first reports: s2's shard holds 8
        time.sleep(REMOTE_DEPTH_REFRESH_S)
        with pytest.raises(grpc.RpcError) as refused:
            send(0, 2)
        assert "max depth" in (refused.value.details() or "")


# Shard 0 led by s1 and copied to s3, so a hung s2 leads shard 1 and holds nothing of
# shard 0's; leases long enough that s2 stays shard 1's leader while it hangs.
HUNG_S2 = [["s1", "s3"], ["s2", "s1"], ["s3", "s1"]]
SEND_DEADLINE_S = 0.75 * REMOTE_DEPTH_WITHIN_S


@pytest.mark.timeout(120)
def test_a_hung_leader_elsewhere_does_not_hold_up_sends_to_a_bounded_queue(tmp_path: pathlib.Path) -> None:
    """With s2 SIGSTOPped (a frozen pod), sends through s1 to its own shard, for more than
    one refresh of the other leaders' reports, are each answered within a deadline shorter
    than the time s2 has to report: s1 asks in the background and goes on with s2's last
    report, which still counts against maxDepth. Before, the send that found the reports
    old asked s2 and waited REMOTE_DEPTH_WITHIN_S for it, one send a second."""
    bounded = Cluster(tmp_path / "cluster", placement=HUNG_S2, spec={"max_depth": 100}, lease_ms=20_000)
    with bounded_through_s1(bounded, deadline_s=SEND_DEADLINE_S) as (cluster, send):
        assert all(result.message_id for result in send(1, 8).results)  # forwarded to s2
        time.sleep(REMOTE_DEPTH_REFRESH_S)
        assert send(0, 1).results[0].message_id  # s1's first reports: s2's shard holds 8
        assert cluster.leader_of(1).holder == "s2"
        os.kill(cluster.processes["s2"].pid, signal.SIGSTOP)
        try:
            sent = 0
            until = time.monotonic() + 3 * REMOTE_DEPTH_REFRESH_S
            while time.monotonic() < until:
                # DEADLINE_EXCEEDED when the send waits for s2's report.
                assert send(0, 1).results[0].message_id
                sent += 1
                time.sleep(0.1)
            assert cluster.leader_of(1).holder == "s2", "s2 must still lead shard 1 for this to test anything"
            # 1 + sent on shard 0, and s2's 8 as it last reported them: one more batch
            # that fills the queue to 101 is refused.
            with pytest.raises(grpc.RpcError) as refused:
                send(0, 100 - 8 - (1 + sent) + 1)
            assert "max depth" in (refused.value.details() or "")
        finally:
            os.kill(cluster.processes["s2"].pid, signal.SIGCONT)
