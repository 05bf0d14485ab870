"""A send made through a server that does not lead the shard is forwarded to the leader.

- Cut off after it was sent (the leader killed mid-call), the leader may have stored it,
  so the caller hears OUTCOME_UNKNOWN, as it does when its own connection to a leader
  fails mid-call. It heard UNAVAILABLE ("nothing stored"), and a producer that sends
  again on UNAVAILABLE, as producers do, could store the message twice.
- A send that cannot reach the leader (its port refused) applied nothing. One whose
  messages may go to any shard (unkeyed, unpinned) goes to another shard's leader at
  once. Any other follows the shard to its next leader once the lease is taken over,
  rather than failing at once, and says UNAVAILABLE only when no new leader comes
  within its bound.

Real servers and real signals: the leader is SIGSTOPped so that the forwarded request is
certainly on its way and unanswered, then SIGKILLed, which cuts the connection under it.
The takeover is made as the supervisor or the operator makes it (a lease compare-and-swap
once the dead leader's lease expired).
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import time
import zlib
from collections.abc import Iterator

import grpc
import pytest

from shard_server.runtime.hosting import SEND_FOLLOWS_FAILOVER_WITHIN_S
from shardq import Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.fencing import build_takeover, is_expired
from shardq.coordination.leases import LeaseRecord
from shardq.errors import Reason, Unavailable
from shardq.status import error_from_rpc
from tests.integration.scraping import samples, scrape_text, value
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import wait_for

# THREE_LEADERS: shards 0, 1 and 2 led by s1, s2 and s3; sends go to s1, for shard 1.
QUEUE = "orders"
SHARD_LED_BY_S2 = 1


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    # Leases of a minute: s2 stays the leader of shard 1 for the whole test.
    yield from running(Cluster(tmp_path / "cluster", placement=THREE_LEADERS, lease_ms=60_000))


@pytest.fixture
def failing_over(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    # Leases of 3 s: the dead leader's lease runs out within the test, and a send follows
    # the shard for up to three of them.
    yield from running(Cluster(tmp_path / "cluster", placement=THREE_LEADERS, lease_ms=3_000))


def send(stub: queue_pb2_grpc.QueueServiceStub, body: bytes) -> queue_pb2.SendMessagesResponse:
    request = queue_pb2.SendMessagesRequest(
        queue=QUEUE, shard=SHARD_LED_BY_S2, messages=[queue_pb2.MessageToSend(body=body)]
    )
    # Longer than a send follows a failover, so that the server's own answer is heard.
    response: queue_pb2.SendMessagesResponse = stub.SendMessages(request, timeout=SEND_FOLLOWS_FAILOVER_WITHIN_S + 10)
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
            time.sleep(2.0)  # forwarded and waiting on the stopped leader (s1 is idle: ample)
            assert not cut_off.done(), "the forwarded send waits for the stopped leader"
            cluster.kill("s2")
            assert cut_off.result(timeout=15) is Reason.OUTCOME_UNKNOWN

        # Now s2's port refuses, and nobody takes its lease of a minute over: a forward
        # never reaches a leader, and says so once it has waited for one long enough.
        began = time.monotonic()
        assert failure_of(stub, b"never sent") is Reason.UNAVAILABLE
        assert time.monotonic() - began >= SEND_FOLLOWS_FAILOVER_WITHIN_S - 1, "it waited for a new leader"


def expired_lease_of_shard_1(cluster: Cluster) -> LeaseRecord:
    def expired() -> LeaseRecord | None:
        lease = cluster.leader_of(SHARD_LED_BY_S2)
        return lease if is_expired(lease, int(time.time() * 1000)) else None

    return wait_for(expired, timeout=20, what="the dead leader's lease to expire")


@pytest.mark.timeout(120)
def test_a_send_through_another_server_follows_the_shard_to_its_next_leader(failing_over: Cluster) -> None:
    cluster = failing_over
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
        send(stub, b"before")
        cluster.kill("s2")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            during = pool.submit(send, stub, b"during the failover")
            expired = expired_lease_of_shard_1(cluster)
            assert not during.done(), f"answered with no leader to store it: {during.exception() or during.result()}"
            # s3, shard 1's other replica, takes the dead leader's lease over.
            cluster.leases.update(
                build_takeover(expired, new_holder="s3", now_ms=int(time.time() * 1000), duration_ms=cluster.lease_ms)
            )
            (stored,) = during.result(timeout=SEND_FOLLOWS_FAILOVER_WITHIN_S + 10).results
        assert not stored.HasField("error"), stored.error
        assert stored.message_id
        assert stored.shard == SHARD_LED_BY_S2
    assert cluster.leader_of(SHARD_LED_BY_S2).holder == "s3"
    with grpc.insecure_channel(cluster.endpoint("s3")) as to_s3:
        request = queue_pb2.ReceiveMessagesRequest(queue=QUEUE, shard=SHARD_LED_BY_S2, max_messages=10, peek=True)
        shown = queue_pb2_grpc.QueueServiceStub(to_s3).ReceiveMessages(request, timeout=10).messages
    assert sorted(message.body for message in shown) == [b"before", b"during the failover"]


@pytest.mark.timeout(120)
def test_unkeyed_sends_through_another_server_go_to_the_shards_that_are_led(cluster: Cluster) -> None:
    """The leader of shard 1 dies and nobody takes its lease of a minute over: every send
    that could go to any shard is stored at once, on shards 0 and 2."""
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
        cluster.kill("s2")
        shards = []
        for n in range(12):  # one in three is meant for shard 1, round robin
            request = queue_pb2.SendMessagesRequest(queue=QUEUE, messages=[queue_pb2.MessageToSend(body=b"%d" % n)])
            # Well inside the 10 s a send for shard 1 alone would wait for a new leader.
            (stored,) = stub.SendMessages(request, timeout=5).results
            assert not stored.HasField("error"), stored.error
            shards.append(stored.shard)
    assert set(shards) == {0, 2}
    moved = value(
        samples(scrape_text(cluster.metrics_url("s1"))),
        "shardq_messages_moved_off_unled_shards_total",
        queue=QUEUE,
        shard="1",
    )
    assert moved >= 1, "some sends were meant for shard 1 and moved off it"


@pytest.mark.timeout(120)
def test_a_clients_unkeyed_sends_go_to_the_shards_that_are_led(cluster: Cluster) -> None:
    """The client sends each shard's part straight to its leader. With shard 1's leader
    dead (and, its lease of a minute untaken, no new one coming), a send it chose shard 1
    for goes to the server it was given, unpinned, which places it on a led shard; a send
    with a dedup id stays with its shard and says UNAVAILABLE, for nothing took it."""
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        wait_for(lambda: every_shard_led(queue_pb2_grpc.QueueServiceStub(channel)), timeout=30, what="every shard led")
    with Client(cluster.endpoint("s1")) as client:
        client.send_messages(QUEUE, [Message(b"routes known")])
        cluster.kill("s2")
        stored = [client.send_messages(QUEUE, [Message(b"%d" % n)])[0] for n in range(12)]
        assert [result.error_reason for result in stored] == [""] * 12
        assert {result.shard for result in stored} == {0, 2}
        # A dedup id whose shard is 1 (crc32 of it, modulo 3).
        keyed = next(f"k{n}" for n in range(100) if zlib.crc32(f"k{n}".encode()) % 3 == SHARD_LED_BY_S2)
        with pytest.raises(Unavailable):
            client.send_messages(QUEUE, [Message(b"keyed", dedup_id=keyed)])
