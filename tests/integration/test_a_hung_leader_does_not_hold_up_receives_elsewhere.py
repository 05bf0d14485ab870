"""A receive through one server asks the other leaders when its own shards are empty;
one hung leader (SIGSTOPped, as a frozen pod or a cut network looks) may cost it one
short poll's timeout, once, and never more. The others' messages still come, a long
poll ends near its wait, and later receives skip the hung leader for a while, until it
answers a call again. Before,
each hung leader cost every receive 10 s, asked in turn: a short poll outlived a 5 s
deadline, and a long poll could overrun its wait by 10 s per hung leader."""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from shard_server.runtime.forwarding import REMOTE_SHORT_POLL_S, UNANSWERED_LEADER_SKIPPED_S
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import wait_for

# THREE_LEADERS: shards 0, 1 and 2 led by s1, s2 and s3. Receives go to s1, which asks
# s2 before s3 (in name order), and s2 is the one that hangs.
QUEUE = "orders"
WAIT_MS = 2_000


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=THREE_LEADERS, lease_ms=60_000))


def send_to_shard_led_by_s3(stub: queue_pb2_grpc.QueueServiceStub, bodies: list[bytes]) -> None:
    request = queue_pb2.SendMessagesRequest(
        queue=QUEUE, shard=2, messages=[queue_pb2.MessageToSend(body=body) for body in bodies]
    )
    response = stub.SendMessages(request, timeout=10)
    assert all(result.message_id for result in response.results), response


def receive(
    stub: queue_pb2_grpc.QueueServiceStub, *, wait_ms: int, deadline_s: float, shard: int | None = None
) -> list[bytes]:
    request = queue_pb2.ReceiveMessagesRequest(
        queue=QUEUE, max_messages=10, wait_time_ms=wait_ms, visibility_timeout_ms=60_000
    )
    if shard is not None:
        request.shard = shard
    return sorted(message.body for message in stub.ReceiveMessages(request, timeout=deadline_s).messages)


@pytest.mark.timeout(120)
def test_a_hung_leader_costs_receives_elsewhere_one_short_poll(cluster: Cluster) -> None:
    hung = cluster.processes["s2"].pid
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
        send_to_shard_led_by_s3(stub, [b"a", b"b", b"c"])
        os.kill(hung, signal.SIGSTOP)
        try:
            # The first receive finds s1's shard empty and asks s2 first: it may wait
            # for that short poll to time out, then s3 answers.
            first = receive(stub, wait_ms=0, deadline_s=REMOTE_SHORT_POLL_S + 3)
            hung_at = time.monotonic()
            assert first == [b"a", b"b", b"c"]
            # Then s2 is skipped: a deadline shorter than one short poll's timeout is met.
            send_to_shard_led_by_s3(stub, [b"d", b"e"])
            assert receive(stub, wait_ms=0, deadline_s=REMOTE_SHORT_POLL_S / 2) == [b"d", b"e"]
            # A long poll of an empty queue ends with its wait, not a hung leader's timeout.
            assert receive(stub, wait_ms=WAIT_MS, deadline_s=WAIT_MS / 1000 + REMOTE_SHORT_POLL_S / 2) == []
            assert time.monotonic() - hung_at < UNANSWERED_LEADER_SKIPPED_S, "the checks above ran within the skip"
        finally:
            os.kill(hung, signal.SIGCONT)
        # Back: a receive of s2's shard alone asks s2 whatever the skip (a call for one
        # shard asks its leader), and s2's answer ends the skip at once: s2's shard is
        # served through s1 again well before the skip would have run out.
        assert receive(stub, wait_ms=0, deadline_s=5, shard=1) == []
        request = queue_pb2.SendMessagesRequest(queue=QUEUE, shard=1, messages=[queue_pb2.MessageToSend(body=b"f")])
        assert stub.SendMessages(request, timeout=10).results[0].message_id
        assert receive(stub, wait_ms=0, deadline_s=5) == [b"f"]
        assert time.monotonic() - hung_at < UNANSWERED_LEADER_SKIPPED_S, "s2 was asked again within its skip"
