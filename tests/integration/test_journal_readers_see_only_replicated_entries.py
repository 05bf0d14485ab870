"""A replicated shard's journal ends at what every in-sync replica holds: an entry the
leader wrote but its follower has not, which a failover could still lose, is not shown
to a journal reader (the Spark report) until it is replicated."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
from collections.abc import Iterator

import grpc
import pytest

from shardq import Client, Message, SendResult
from shardq.api.v1 import export_pb2, export_pb2_grpc
from tests.integration.scraping import samples, scrape_text, value
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import wait_for

# One shard on s1 and s2; s1 leads.
PLACEMENT = [["s1", "s2"]]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


def journal_last_index(cluster: Cluster) -> int:
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        bounds = stub.GetJournalBounds(export_pb2.GetJournalBoundsRequest(queue="orders", shard=0), timeout=5)
    return int(bounds.last_index)


def journal_events(cluster: Cluster) -> list[export_pb2.JournalEvent]:
    with grpc.insecure_channel(cluster.endpoint("s1")) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        batches = stub.ReadJournal(export_pb2.ReadJournalRequest(queue="orders", shard=0), timeout=5)
        return [event for batch in batches for event in batch.events]


def sent_ids(cluster: Cluster) -> set[str]:
    return {event.message_id for event in journal_events(cluster) if event.type == export_pb2.JOURNAL_EVENT_TYPE_SENT}


def commits(cluster: Cluster) -> float:
    return value(samples(scrape_text(cluster.metrics_url("s1"))), "shardq_commits_total", queue="orders", shard="0")


@pytest.mark.timeout(90)
def test_an_entry_not_yet_on_the_follower_is_not_in_the_journal(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        first = send_once_led(client, b"replicated")
        replicated_last = journal_last_index(cluster)
        assert first.message_id in sent_ids(cluster)
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
