"""A follower restarted while its leader takes writes rejoins the ISR once and stays.

The leader re-admits a follower when it holds every entry written, then records the
larger ISR in the lease. Entries committed without the joiner while that write was in
flight left it lacking a committed entry: the leader dropped it again at once (the ISR
flapped on most rejoins under load), and for that moment the lease named an in-sync
replica that could have been promoted without an acknowledged write."""

from __future__ import annotations

import pathlib
import re
import threading
import time
from collections.abc import Iterator

import pytest

from shardq import Client, Message, ShardqError
from tests.integration.scraping import samples, scrape_text, value
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import wait_for

PLACEMENT = [["s1", "s2"]]
SENDERS = 6
LOAD_LIMIT_S = 60.0
ISR_LINE = re.compile(r"orders\.0: ISR is now (\[.*\])")


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


def in_sync_replicas(cluster: Cluster) -> float:
    metrics = samples(scrape_text(cluster.metrics_url("s1")))
    return value(metrics, "shardq_shard_in_sync_replicas", queue="orders", shard="0")


def isr_changes(cluster: Cluster) -> list[str]:
    """s1's ISR changes for the shard, in order, as its log records them."""
    return ISR_LINE.findall((cluster.root / "s1.log").read_text())


@pytest.mark.timeout(180)
def test_a_restarted_follower_rejoins_once_and_stays_while_writes_go_on(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        send_once_led(client, b"first")
    stop = threading.Event()
    acknowledged = [0] * SENDERS
    deadline = time.monotonic() + LOAD_LIMIT_S

    def send_until_stopped(sender: int) -> None:
        with Client(cluster.endpoint("s1"), route_directly=False) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    client.send_messages("orders", [Message(b"x" * 256)])
                except ShardqError:
                    continue
                acknowledged[sender] += 1

    senders = [threading.Thread(target=send_until_stopped, args=(i,), daemon=True) for i in range(SENDERS)]
    for thread in senders:
        thread.start()
    try:
        wait_for(lambda: sum(acknowledged) > 200, timeout=30, what="the load running")
        cluster.kill("s2")
        wait_for(lambda: in_sync_replicas(cluster) == 1, timeout=15, what="s2 dropped from the ISR")
        cluster.start("s2")
        wait_for(lambda: in_sync_replicas(cluster) == 2, timeout=30, what="s2 back in the ISR")
        rejoined_with = sum(acknowledged)
        # Writes go on past the rejoin: each commit now needs s2.
        wait_for(lambda: sum(acknowledged) > rejoined_with + 500, timeout=30, what="writes after the rejoin")
    finally:
        stop.set()
        for thread in senders:
            thread.join(timeout=30)
    assert isr_changes(cluster) == ["['s1']", "['s1', 's2']"], "the ISR changed more than once per event"
