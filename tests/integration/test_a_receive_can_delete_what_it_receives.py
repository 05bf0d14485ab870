"""A receive with delete_on_receive (pgmq's pop, AMQP's auto-ack) deletes what it hands
out in the same commit: at most once. Those messages have no receipt, are never handed
out again (not to another receive, not after a SIGKILL and a restart), free a FIFO
group at once, and are deleted on their shard's leader when another server forwards
the call. Several callers' such short polls share a request, each taking its own.
Asked with a peek, it is refused and the request names the field; the CLI's
`receive --delete` prints no receipts."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import grpc
import pytest

from shardq import AsyncClient, Client, Message, ReceivedMessage
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import Reason
from shardq.status import error_from_rpc
from tests.support.clusters import THREE_LEADERS, Cluster, every_shard_led, running
from tests.support.servers import ServerProcess, wait_for


def bodies(messages: Sequence[ReceivedMessage | queue_pb2.ReceivedMessage]) -> list[bytes]:
    return sorted(message.body for message in messages)


@pytest.mark.timeout(60)
def test_what_a_deleting_receive_takes_is_never_handed_out_again(server: ServerProcess, client: Client) -> None:
    client.send_messages("orders", [Message(b"m%d" % n) for n in range(6)])
    taken = client.receive_messages("orders", max_messages=4, delete_on_receive=True)
    assert len(taken) == 4
    assert all(message.receipt == "" for message in taken), "deleted: nothing to act on"
    attributes = client.attributes("orders")
    assert (attributes.visible, attributes.in_flight) == (2, 0)
    # Durable when answered: a SIGKILL straight after does not bring them back.
    server.kill()
    server.restart()
    with Client(server.endpoint) as after:
        rest = after.receive_messages("orders", max_messages=10, visibility_timeout_ms=60_000)
    assert sorted(bodies(taken) + bodies(rest)) == [b"m%d" % n for n in range(6)]
    assert not set(bodies(taken)) & set(bodies(rest))


@pytest.mark.timeout(60)
def test_a_deleting_receive_frees_a_fifo_group_at_once(client: Client) -> None:
    client.send_messages("fifo", [Message(b"a1", group_id="a"), Message(b"a2", group_id="a")])
    (first,) = client.receive_messages("fifo", max_messages=1, delete_on_receive=True)
    assert first.body == b"a1"
    # Claimed and not deleted, a1 would hold group a until its visibility timeout.
    (second,) = client.receive_messages("fifo", max_messages=1, visibility_timeout_ms=60_000)
    assert second.body == b"a2"


@pytest.mark.timeout(60)
def test_a_deleting_peek_is_refused(server: ServerProcess, client: Client) -> None:
    client.send_messages("orders", [Message(b"kept")])
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        request = queue_pb2.ReceiveMessagesRequest(queue="orders", max_messages=1, peek=True, delete_on_receive=True)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReceiveMessages(request, timeout=10)
    error = error_from_rpc(refused.value)
    assert (error.reason, error.field) == (Reason.INVALID_ARGUMENT, "delete_on_receive"), error
    assert client.attributes("orders").visible == 1, "nothing was claimed or deleted"


@pytest.mark.timeout(60)
def test_shared_deleting_receives_each_take_their_own_and_leave_nothing_claimed(
    server: ServerProcess, client: Client
) -> None:
    client.send_messages("orders", [Message(b"m%d" % n) for n in range(12)])
    # On the wire: one request for two receivers, answered share by share.
    with grpc.insecure_channel(server.endpoint) as channel:
        request = queue_pb2.ReceiveMessagesRequest(queue="orders", shares=[2, 3], delete_on_receive=True)
        response = queue_pb2_grpc.QueueServiceStub(channel).ReceiveMessages(request, timeout=10)
    assert list(response.share_counts) == [2, 3]
    assert all(message.receipt == "" for message in response.messages)
    assert all(message.visible_until_ms == 0 for message in response.messages), "never to be visible again"
    # Through the client: concurrent callers' deleting short polls share requests.

    async def six_callers() -> list[list[ReceivedMessage]]:
        async with AsyncClient(server.endpoint) as shared:
            return await asyncio.gather(
                *(shared.receive_messages("orders", max_messages=1, delete_on_receive=True) for _ in range(6))
            )

    taken = [message for part in asyncio.run(six_callers()) for message in part]
    assert len(taken) == 6
    assert all(message.receipt == "" for message in taken)
    assert len(set(bodies([*response.messages, *taken]))) == 11
    attributes = client.attributes("orders")
    assert (attributes.visible, attributes.in_flight) == (1, 0), "deleted, not left claimed"


@pytest.mark.timeout(60)
def test_the_cli_receives_deleting_and_prints_no_receipts(server: ServerProcess, client: Client) -> None:
    client.send_messages("orders", [Message(b"one"), Message(b"two")])
    cli = [sys.executable, "-m", "shardq", "receive", "--endpoint", server.endpoint, "--queue", "orders"]
    done = subprocess.run([*cli, "--max", "5", "--delete"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line.split("\t")[1] for line in lines) == ["one", "two"]
    assert all(len(line.split("\t")) == 2 for line in lines), "message id and body, no receipt"
    assert client.attributes("orders").visible == 0
    assert client.attributes("orders").in_flight == 0
    refused = subprocess.run([*cli, "--peek", "--delete"], capture_output=True, text=True, timeout=30, check=False)
    assert refused.returncode != 0
    assert "--peek changes nothing: it cannot be used with --delete" in refused.stderr, refused.stderr


@pytest.mark.timeout(120)
def test_a_forwarded_deleting_receive_deletes_on_the_shards_leader(tmp_path: pathlib.Path) -> None:
    # Shards 0, 1, 2 led by s1, s2, s3; the receive goes to s1, whose own shard is empty.
    with contextlib.contextmanager(running)(Cluster(tmp_path / "cluster", placement=THREE_LEADERS)) as cluster:
        with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            wait_for(lambda: every_shard_led(stub), timeout=30, what="every shard led")
            sent = stub.SendMessages(
                queue_pb2.SendMessagesRequest(
                    queue="orders", shard=1, messages=[queue_pb2.MessageToSend(body=b"on s2")]
                ),
                timeout=10,
            )
            assert sent.results[0].message_id
            request = queue_pb2.ReceiveMessagesRequest(queue="orders", max_messages=10, delete_on_receive=True)
            (taken,) = stub.ReceiveMessages(request, timeout=10).messages
            assert (taken.body, taken.shard, taken.receipt) == (b"on s2", 1, "")
        with grpc.insecure_channel(cluster.endpoint("s2")) as channel:
            counts = queue_pb2_grpc.QueueServiceStub(channel).GetQueueAttributes(
                queue_pb2.GetQueueAttributesRequest(queue="orders"), timeout=10
            )
        (shard_1,) = [shard for shard in counts.shards if shard.shard == 1]
        assert (shard_1.visible, shard_1.in_flight) == (0, 0), "deleted on its leader, not left claimed"
