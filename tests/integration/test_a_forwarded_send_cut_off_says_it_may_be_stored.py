"""A send made through a server that does not lead the shard is forwarded to the leader.
Cut off after it was sent (the leader killed mid-call), the leader may have stored it, so
the caller hears OUTCOME_UNKNOWN, as it does when its own connection to a leader fails
mid-call; it heard UNAVAILABLE ("nothing stored"), and a producer that sends again on
UNAVAILABLE, as producers do, could store the message twice. A send that never reached the
leader (its port refused) still says UNAVAILABLE: sending it again is safe.

Real servers and real signals: the leader is SIGSTOPped so that the forwarded request is
certainly on its way and unanswered, then SIGKILLed, which cuts the connection under it.
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

from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import Reason
from shardq.status import error_from_rpc
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import wait_for

# THREE_LEADERS: shards 0, 1 and 2 led by s1, s2 and s3; sends go to s1, for shard 1.
QUEUE = "orders"
SHARD_LED_BY_S2 = 1


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    # Leases of a minute: s2 stays the leader of shard 1 for the whole test.
    yield from running(Cluster(tmp_path / "cluster", placement=THREE_LEADERS, lease_ms=60_000))


def send(stub: queue_pb2_grpc.QueueServiceStub, body: bytes) -> queue_pb2.SendMessagesResponse:
    request = queue_pb2.SendMessagesRequest(
        queue=QUEUE, shard=SHARD_LED_BY_S2, messages=[queue_pb2.MessageToSend(body=body)]
    )
    response: queue_pb2.SendMessagesResponse = stub.SendMessages(request, timeout=20)
    return response


def failure_of(stub: queue_pb2_grpc.QueueServiceStub, body: bytes) -> Reason:
    with pytest.raises(grpc.RpcError) as raised:
        send(stub, body)
    return error_from_rpc(raised.value).reason


@pytest.mark.timeout(120)
def test_a_forwarded_send_cut_off_is_outcome_unknown_and_one_never_sent_is_unavailable(cluster: Cluster) -> None:
    leader = cluster.processes["s2"]
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
        # The connection s1 forwards on is open before the leader stops: the request
        # then goes out on it, rather than waiting for a connection to be made.
        (stored,) = send(stub, b"before").results
        assert stored.message_id
        assert stored.shard == SHARD_LED_BY_S2

        os.kill(leader.pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            cut_off = pool.submit(failure_of, stub, b"cut off")
            time.sleep(1.0)  # forwarded and waiting on the stopped leader
            assert not cut_off.done(), "the forwarded send waits for the stopped leader"
            cluster.kill("s2")
            assert cut_off.result(timeout=15) is Reason.OUTCOME_UNKNOWN

        # Now s2's port refuses: a forward never reaches it, and says so.
        assert failure_of(stub, b"never sent") is Reason.UNAVAILABLE
