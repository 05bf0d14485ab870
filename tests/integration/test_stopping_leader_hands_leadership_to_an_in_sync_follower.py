"""A leader told to stop (SIGTERM: a rolling restart, a scale-in, a deleted pod) hands
each shard it leads to an in-sync follower in a new epoch before it exits, instead of
leaving the shard leaderless until its lease expires. Nobody else takes leases over in
this test and the leases last 60 s, so a new leader can only come from the hand-off;
every message acknowledged before and after is still there."""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Iterator

import pytest

from shardq import Client, Message
from shardq.coordination.fencing import isr_of
from tests.support.clusters import Cluster, running
from tests.support.servers import drain, wait_for

LONG_LEASE_MS = 60_000


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", lease_ms=LONG_LEASE_MS))


def send(client: Client, bodies: list[bytes]) -> None:
    results = client.send_messages("orders", [Message(body) for body in bodies])
    assert all(result.ok for result in results), results


@pytest.mark.timeout(90)
def test_a_stopping_leader_hands_its_shards_to_in_sync_followers(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s3"), route_directly=False) as client:
        wait_for(lambda: client.list_queues() == ["orders"], timeout=30, what="the cluster serving")

        def all_accepted() -> bool:
            try:
                send(client, [b"warm-up"])
            except Exception:  # leaders still starting
                return False
            return True

        wait_for(all_accepted, timeout=30, interval=0.2, what="a first send accepted")
        before = [f"before-{i}".encode() for i in range(40)]
        for start in range(0, len(before), 10):
            send(client, before[start : start + 10])
        old = cluster.leader_of(0)
        assert old.holder == "s1"
        isr_then = isr_of(old)
        assert len(isr_then) == 3, f"every replica should be in sync before the stop: {sorted(isr_then)}"

        process = cluster.processes.pop("s1")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0

        new = cluster.leader_of(0)
        assert new.transitions == old.transitions + 1, "the lease was not handed over in a new epoch"
        assert new.holder in isr_then - {"s1"}
        assert "s1" not in isr_of(new)
        # Handed over, not expired: the old lease had most of its minute left.
        assert new.acquire_time_ms < old.renew_time_ms + old.duration_ms

        after = [f"after-{i}".encode() for i in range(40)]
        for start in range(0, len(after), 10):
            send(client, after[start : start + 10])
        received = {message.body for message in drain(client, "orders")}
    assert set(before) | set(after) <= received
    log = (cluster.root / "s1.log").read_text()
    assert "leadership handed to" in log
