"""A replicated shard's journal ends at what every in-sync replica holds: an entry the
leader wrote but its follower has not, which a failover could still lose, is not shown
to a journal reader (the Spark report) until it is replicated; a message snapshot
waits for it to be replicated before it shows the message. And right after a
failover the new leader shows what the old one had committed: its own commit index
starts over, and stayed at 0 while its dead predecessor was still in the ISR, so a
report read then lost the whole shard."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client, Message, SendResult
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.coordination.fencing import build_takeover, is_expired
from shardq.coordination.leases import LeaseRecord
from tests.integration.scraping import samples, scrape_text, value
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import wait_for

# One shard on s1 and s2; s1 leads.
PLACEMENT = [["s1", "s2"]]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


def journal_last_index(cluster: Cluster, server: str = "s1") -> int:
    with grpc.insecure_channel(cluster.endpoint(server)) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        bounds = stub.GetJournalBounds(export_pb2.GetJournalBoundsRequest(queue="orders", shard=0), timeout=5)
    return int(bounds.last_index)


def journal_events(cluster: Cluster, server: str = "s1") -> list[export_pb2.JournalEvent]:
    with grpc.insecure_channel(cluster.endpoint(server)) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        batches = stub.ReadJournal(export_pb2.ReadJournalRequest(queue="orders", shard=0), timeout=5)
        return [event for batch in batches for event in batch.events]


def sent_ids(cluster: Cluster, server: str = "s1") -> set[str]:
    events = journal_events(cluster, server)
    return {event.message_id for event in events if event.type == export_pb2.JOURNAL_EVENT_TYPE_SENT}


def exported_bodies(cluster: Cluster) -> set[bytes]:
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        request = export_pb2.ExportMessagesRequest(queue="orders", shard=0, include_body=True)
        return {message.body for batch in stub.ExportMessages(request, timeout=10) for message in batch.messages}


def commits(cluster: Cluster) -> float:
    return value(samples(scrape_text(cluster.metrics_url("s1"))), "shardq_commits_total", queue="orders", shard="0")


def follower_in_sync(cluster: Cluster) -> bool:
    """s1 counts s2 among its in-sync replicas: a write then waits for s2 (a follower
    that started late or lagged is out of the ISR until s1 re-admits it)."""
    metrics = samples(scrape_text(cluster.metrics_url("s1")))
    return value(metrics, "shardq_shard_in_sync_replicas", queue="orders", shard="0") == 2


def known_commit_index(cluster: Cluster, server: str) -> float:
    metrics = samples(scrape_text(cluster.metrics_url(server)))
    return value(metrics, "shardq_shard_commit_index", queue="orders", shard="0")


@pytest.mark.timeout(90)
def test_an_entry_not_yet_on_the_follower_is_not_in_the_journal(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        first = send_once_led(client, b"replicated")
        replicated_last = journal_last_index(cluster)
        assert first.message_id in sent_ids(cluster)
        wait_for(lambda: follower_in_sync(cluster), timeout=10, what="s2 in the ISR")
        committed_before = commits(cluster)

        os.kill(cluster.processes["s2"].pid, signal.SIGSTOP)  # the follower stops taking entries
        try:
            answered = threading.Event()
            unreplicated: list[SendResult] = []

            def send_unreplicated() -> None:
                unreplicated.extend(client.send_messages("orders", [Message(b"only on the leader")]))
                answered.set()

            sending = threading.Thread(target=send_unreplicated, daemon=True)
            sending.start()
            # Written and committed on s1 (its commit counter moved), not on s2: the send
            # waits for its follower, until s1 drops the silent follower from the ISR (1 s).
            wait_for(lambda: commits(cluster) > committed_before, timeout=5, interval=0.01, what="the local commit")
            last_index, events = journal_last_index(cluster), journal_events(cluster)
            assert not answered.is_set(), "the follower was dropped from the ISR before the journal was read"
            assert last_index == replicated_last
            assert max(event.log_index for event in events) == replicated_last
        finally:
            os.kill(cluster.processes["s2"].pid, signal.SIGCONT)
        sending.join(timeout=30)
        assert answered.is_set()
        # Replicated (or the ISR shrank to the leader): now it is committed, and shown.
        ((stored,),) = (unreplicated,)
        wait_for(lambda: stored.message_id in sent_ids(cluster), timeout=10, what="the entry in the journal")
        assert journal_last_index(cluster) > replicated_last


@pytest.mark.timeout(90)
def test_a_snapshot_shows_a_message_only_once_its_send_is_replicated(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        send_once_led(client, b"replicated")
        assert exported_bodies(cluster) == {b"replicated"}
        wait_for(lambda: follower_in_sync(cluster), timeout=10, what="s2 in the ISR")
        committed_before = commits(cluster)

        os.kill(cluster.processes["s2"].pid, signal.SIGSTOP)  # the follower stops taking entries
        try:
            answered_at: list[float] = []

            def send_unreplicated() -> None:
                client.send_messages("orders", [Message(b"only on the leader")])
                answered_at.append(time.monotonic())

            sending = threading.Thread(target=send_unreplicated, daemon=True)
            sending.start()
            # Committed on s1, not on s2: the send is answered only once s1 drops the
            # silent follower from the ISR (after 1 s); s2 stays stopped until then.
            wait_for(lambda: commits(cluster) > committed_before, timeout=5, interval=0.01, what="the local commit")
            exported = exported_bodies(cluster)
            exported_at = time.monotonic()
            sending.join(timeout=30)
        finally:
            os.kill(cluster.processes["s2"].pid, signal.SIGCONT)
        assert answered_at, "the send was never answered"
        assert b"replicated" in exported
        if b"only on the leader" in exported:
            # Shown, so it had to be committed (the ISR shrank) before the snapshot was
            # answered: the send's answer follows within moments, not a second later.
            assert answered_at[0] - exported_at < 0.5, (
                f"the snapshot showed a message {answered_at[0] - exported_at:.2f}s before its send was committed"
            )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("learned", [True, False], ids=["commit-index-learned", "killed-right-after-the-sends"])
def test_a_new_leader_shows_at_once_what_the_old_one_had_committed(cluster: Cluster, learned: bool) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        sent = {send_once_led(client, f"before the failover {i}".encode()).message_id for i in range(5)}
    last_index = journal_last_index(cluster)
    assert sent <= sent_ids(cluster)
    if learned:
        # The follower has learned the commit index (a heartbeat carries it), as it
        # would long before a report runs.
        wait_for(lambda: known_commit_index(cluster, "s2") >= last_index, timeout=10, what="s2 to learn it")
    # Otherwise s2 may learn it only a heartbeat after the last send: its readers wait
    # until what it inherited is committed again.
    cluster.kill("s1")

    def expired_lease() -> LeaseRecord | None:
        lease = cluster.leader_of(0)
        return lease if is_expired(lease, int(time.time() * 1000)) else None

    expired = wait_for(expired_lease, timeout=20, what="the dead leader's lease to expire")
    cluster.leases.update(
        build_takeover(expired, new_holder="s2", now_ms=int(time.time() * 1000), duration_ms=cluster.lease_ms)
    )

    def bounds_on_the_new_leader() -> int | None:
        try:
            return journal_last_index(cluster, "s2") + 1  # +1: an empty journal is an answer too
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.FAILED_PRECONDITION:  # NOT_LEADER: not promoted yet
                return None
            raise

    # The first answer s2 gives as leader, while s1 (dead) is still in its ISR.
    shown = wait_for(bounds_on_the_new_leader, timeout=20, interval=0.01, what="s2 to lead") - 1
    assert shown == last_index, f"the new leader's journal ends at {shown}, the old one's committed {last_index}"
    assert sent <= sent_ids(cluster, "s2")
