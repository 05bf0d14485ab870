"""A leader told to stop (SIGTERM: a rolling restart, a deleted pod) answers the sends it
already took before it hands its shards off: it takes no new calls, lets its writes
commit, then passes the lease. It used to step down at once, and every send still
waiting for its followers' acknowledgements heard OUTCOME_UNKNOWN, at every pod of every
rolling restart, though it was a heartbeat from committing.

Real servers and real signals. Shard 0 is led by s1 and copied to s2 and s3; s4 holds no
copy and forwards, as the server behind a Service does. Both followers are SIGSTOPped so
that a send is certainly taken and waiting for them when s1 gets SIGTERM; they are let go
again well within the time a silent follower keeps its place in the in-sync set. Leases
last a minute: the new leader can only come from the hand-off.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from shard_server.runtime.hosting import SEND_FOLLOWS_FAILOVER_WITHIN_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.fencing import isr_of
from tests.support.clusters import Cluster, every_shard_led, running
from tests.support.servers import wait_for

QUEUE = "orders"
SHARD_LED_BY_S1 = 0


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", lease_ms=60_000, spare_servers=("s4",)))


def send(stub: queue_pb2_grpc.QueueServiceStub, body: bytes) -> queue_pb2.SendResult:
    request = queue_pb2.SendMessagesRequest(
        queue=QUEUE, shard=SHARD_LED_BY_S1, messages=[queue_pb2.MessageToSend(body=body)]
    )
    response = stub.SendMessages(request, timeout=SEND_FOLLOWS_FAILOVER_WITHIN_S + 10)
    (result,) = response.results
    return result


def bodies_on_shard_0(stub: queue_pb2_grpc.QueueServiceStub) -> set[bytes]:
    request = queue_pb2.ReceiveMessagesRequest(queue=QUEUE, shard=SHARD_LED_BY_S1, max_messages=100, peek=True)
    return {message.body for message in stub.ReceiveMessages(request, timeout=10).messages}


@pytest.mark.timeout(120)
def test_a_stopping_leader_answers_the_sends_it_took_before_handing_off(cluster: Cluster) -> None:
    followers = [cluster.processes["s2"], cluster.processes["s3"]]
    with grpc.insecure_channel(cluster.endpoint("s4")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub, shards=2), timeout=30, what="every shard led")
        # Forwarded by s4 on a connection already open, and copied by both followers.
        assert send(stub, b"before").message_id
        wait_for(lambda: len(isr_of(cluster.leader_of(SHARD_LED_BY_S1))) == 3, timeout=10, what="all three in sync")
        old = cluster.leader_of(SHARD_LED_BY_S1)
        assert old.holder == "s1"

        for follower in followers:
            os.kill(follower.pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            try:
                taken = pool.submit(send, stub, b"taken before the stop")
                time.sleep(0.2)  # forwarded, written by s1, waiting for the stopped followers
                assert not taken.done(), "the send waits for its followers' acknowledgements"
                leader = cluster.processes.pop("s1")
                leader.send_signal(signal.SIGTERM)
                time.sleep(0.1)
                # Reaches s1 while it finishes its writes, or once it stopped answering:
                # either way the send follows the shard to the heir.
                during = pool.submit(send, stub, b"sent during the hand-off")
                time.sleep(0.1)
            finally:
                for follower in followers:
                    os.kill(follower.pid, signal.SIGCONT)
            result = taken.result(timeout=30)
            assert result.message_id, "a send taken before the stop is answered as stored"
            assert result.shard == SHARD_LED_BY_S1
            assert during.result(timeout=30).message_id
        assert leader.wait(timeout=30) == 0

        new = cluster.leader_of(SHARD_LED_BY_S1)
        assert new.transitions == old.transitions + 1, "the lease was not handed over in a new epoch"
        assert new.holder in {"s2", "s3"}
        stored = bodies_on_shard_0(stub)
    assert stored == {b"before", b"taken before the stop", b"sent during the hand-off"}
    assert "leadership handed to" in cluster.log("s1")
