"""A delete sent to a server that does not lead the receipts' shard is forwarded to the
leader that server knows of. Here that leader (s1) is stopped with the forwarded delete
waiting on it:

- when the shard fails over meanwhile, the old leader, once it runs again, answers
  NOT_LEADER for each receipt, while the claims live on in the new leader. The
  forwarding server looks the leader up again and deletes there, instead of passing
  NOT_LEADER on to a client that would then see the messages again;
- when the old leader dies instead, the forwarded call was sent and may have been
  applied: each receipt is OUTCOME_UNKNOWN, not UNAVAILABLE ("nothing applied").

And while no server leads a shard (its lease given up, not yet taken over), a call
naming that shard is told NOT_LEADER, with nobody to forward it to.

Real servers, a real SIGSTOP and SIGKILL; the takeover is made as the supervisor or the
operator makes it (a lease compare-and-swap once the stopped leader's lease expired)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from shardq import Client
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.coordination.fencing import build_abdication, build_takeover, is_expired
from shardq.coordination.leases import LeaseConflict, LeaseRecord
from shardq.errors import Reason
from shardq.receipts import decode_receipt
from shardq.status import error_from_rpc
from tests.support.clusters import Cluster, send_until_accepted
from tests.support.servers import wait_for


@dataclasses.dataclass(frozen=True)
class Claimed:
    receipts: list[str]  # of shard 0, which s1 leads
    stored: int  # messages in the queue, claimed ones included


def claim_on_shard_0(cluster: Cluster) -> Claimed:
    with Client(cluster.endpoint("s1")) as client, grpc.insecure_channel(cluster.endpoint("s1")) as to_s1:
        send_until_accepted(client, [b"startup"], shard_hint="startup")
        stub = queue_pb2_grpc.QueueServiceStub(to_s1)
        bodies = [queue_pb2.MessageToSend(body=f"m{i}".encode()) for i in range(10)]
        stub.SendMessages(queue_pb2.SendMessagesRequest(queue="orders", shard=0, messages=bodies), timeout=10)
        claimed = stub.ReceiveMessages(
            queue_pb2.ReceiveMessagesRequest(queue="orders", shard=0, max_messages=10, visibility_timeout_ms=60_000),
            timeout=10,
        )
        receipts = [m.receipt for m in claimed.messages]
        assert len(receipts) >= 5, f"only {len(receipts)} of shard 0's messages were claimed"
        assert {decode_receipt(receipt).shard for receipt in receipts} == {0}
        # Sends are answered once every in-sync replica has them, and replicas apply the
        # log in order: after this one, the followers hold the claims made before.
        one = [queue_pb2.MessageToSend(body=b"x")]
        stub.SendMessages(queue_pb2.SendMessagesRequest(queue="orders", shard=0, messages=one), timeout=10)
    assert cluster.leader_of(0).holder == "s1"
    return Claimed(receipts, stored(cluster, "s3"))


def stored(cluster: Cluster, server: str) -> int:
    """The queue's messages, counted through `server` once every shard's leader answers.
    (Through s3, which asks each leader: s3 is connected to s1 from then on.)"""
    with Client(cluster.endpoint(server)) as client:

        def counted() -> int | None:
            attributes = client.attributes("orders")
            return attributes.visible + attributes.in_flight + attributes.delayed if attributes.complete else None

        return wait_for(counted, timeout=20, what="every shard counted")


@dataclasses.dataclass(frozen=True)
class Deleting:
    answer: concurrent.futures.Future[queue_pb2.DeleteMessagesResponse]
    stopped_leader_pid: int


@pytest.fixture
def delete_waiting_on_stopped_s1(cluster: Cluster) -> Iterator[tuple[Claimed, Deleting]]:
    """s1 stopped, and a delete of its claimed receipts sent through s3 (which still routes
    shard 0 to s1, whose lease has not expired) waiting on it. s1 runs again afterwards."""
    claimed = claim_on_shard_0(cluster)
    pid = cluster.processes["s1"].pid
    with grpc.insecure_channel(cluster.endpoint("s3")) as to_s3, concurrent.futures.ThreadPoolExecutor(1) as pool:
        os.kill(pid, signal.SIGSTOP)
        try:
            request = queue_pb2.DeleteMessagesRequest(queue="orders", receipts=claimed.receipts)
            answer = pool.submit(queue_pb2_grpc.QueueServiceStub(to_s3).DeleteMessages, request, timeout=60)
            yield claimed, Deleting(answer, pid)
        finally:
            if "s1" in cluster.processes:
                os.kill(pid, signal.SIGCONT)


def expired_lease_of_shard_0(cluster: Cluster) -> LeaseRecord:
    def expired() -> LeaseRecord | None:
        lease = cluster.leader_of(0)
        return lease if is_expired(lease, int(time.time() * 1000)) else None

    return wait_for(expired, timeout=20, what="the stopped leader's lease to expire")


@pytest.mark.timeout(120)
def test_a_forwarded_delete_follows_the_shard_to_its_new_leader(
    cluster: Cluster, delete_waiting_on_stopped_s1: tuple[Claimed, Deleting]
) -> None:
    claimed, deleting = delete_waiting_on_stopped_s1
    expired = expired_lease_of_shard_0(cluster)
    assert not deleting.answer.done(), f"answered while its leader was stopped: {deleting.answer.result()}"
    cluster.leases.update(
        build_takeover(expired, new_holder="s2", now_ms=int(time.time() * 1000), duration_ms=cluster.lease_ms)
    )
    with grpc.insecure_channel(cluster.endpoint("s2")) as to_s2:
        peek = queue_pb2.ReceiveMessagesRequest(queue="orders", shard=0, max_messages=1, peek=True)

        def leads_shard_0() -> bool:
            # A peek naming shard 0 is answered by s2 itself only once it leads it.
            try:
                queue_pb2_grpc.QueueServiceStub(to_s2).ReceiveMessages(peek, timeout=5)
            except grpc.RpcError:
                return False
            return True

        wait_for(leads_shard_0, timeout=20, what="s2 to lead shard 0")
    os.kill(deleting.stopped_leader_pid, signal.SIGCONT)

    answer = deleting.answer.result(timeout=60)
    failed = [(r.error.reason, r.error.message) for r in answer.results if not r.ok]
    assert not failed, f"deletes of claims the new leader holds failed: {failed}"
    assert stored(cluster, "s2") == claimed.stored - len(claimed.receipts)


@pytest.mark.timeout(120)
def test_a_forwarded_delete_cut_off_by_its_leaders_death_is_of_unknown_outcome(
    cluster: Cluster, delete_waiting_on_stopped_s1: tuple[Claimed, Deleting]
) -> None:
    claimed, deleting = delete_waiting_on_stopped_s1
    time.sleep(0.5)  # the forwarded delete is on s1's connection by now
    assert not deleting.answer.done(), f"answered while its leader was stopped: {deleting.answer.result()}"
    cluster.kill("s1")

    answer = deleting.answer.result(timeout=60)
    assert [r.error.reason for r in answer.results] == [Reason.OUTCOME_UNKNOWN.value] * len(claimed.receipts), answer


@pytest.mark.timeout(60)
def test_calls_for_a_shard_no_server_leads_are_told_not_leader(cluster: Cluster) -> None:
    """For a moment after a leader gives its lease up no server leads the shard: a call
    naming it, made to another server, is told NOT_LEADER (it forwarded to a server id
    of "" and failed with an internal KeyError before)."""
    with Client(cluster.endpoint("s3")) as client:
        send_until_accepted(client, [b"startup"], shard_hint="startup")

        def abdicate() -> bool | None:
            try:
                cluster.leases.update(build_abdication(cluster.leader_of(0), leaving="s1"))  # no takeover follows
            except LeaseConflict:
                return None  # s1 renewed between the read and the write
            return True

        wait_for(abdicate, timeout=10, what="s1's lease given up")
        wait_for(lambda: client.describe("orders")[0].leader_address == "" or None, timeout=10, what="no leader")
    with grpc.insecure_channel(cluster.endpoint("s3")) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        one = [queue_pb2.MessageToSend(body=b"x")]
        calls: dict[str, Callable[[], object]] = {
            "receive": lambda: stub.ReceiveMessages(
                queue_pb2.ReceiveMessagesRequest(queue="orders", shard=0, max_messages=1), timeout=10
            ),
            "shared short polls": lambda: stub.ReceiveMessages(
                queue_pb2.ReceiveMessagesRequest(queue="orders", shard=0, shares=[1, 1]), timeout=10
            ),
            "peek": lambda: stub.ReceiveMessages(
                queue_pb2.ReceiveMessagesRequest(queue="orders", shard=0, max_messages=1, peek=True), timeout=10
            ),
            "send": lambda: stub.SendMessages(
                queue_pb2.SendMessagesRequest(queue="orders", shard=0, messages=one), timeout=10
            ),
        }
        for what, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert error_from_rpc(refused.value).reason is Reason.NOT_LEADER, (what, refused.value)
