"""Leases made anew (deleted by hand, restored from an old backup) while the servers' volumes
kept data of later epochs: the shard still gets a leader, and what it acknowledges
survives the next failover.

Before, a holder whose data had seen a later epoch than its lease never led (it waited
for failovers to raise the lease past that epoch, one lease duration each); a follower
that had seen a later epoch made each new leader step down; and a leader of an epoch the
other replica had seen led by another server had its entries skipped as ones already
held, so its acknowledged sends were gone after a failover. Now the holder raises its
lease's epoch above every one its replicas have seen (by CAS) and leads there. Real
servers, killed with SIGKILL, and a real lease store written as the operator would."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import time
from collections.abc import Iterator

import pytest

from shardq import Client, Message, ShardqError
from shardq.coordination.fencing import build_isr_change, build_takeover, incarnations_of, is_expired, isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import build_initial_lease
from tests.support.clusters import LEASE_MS, Cluster, running
from tests.support.servers import wait_for

PAIR = [["s1", "s2"]]
started = contextlib.contextmanager(running)


def now_ms() -> int:
    return int(time.time() * 1000)


def send_all(cluster: Cluster, server: str, bodies: list[bytes]) -> None:
    with Client(cluster.endpoint(server)) as client:

        def attempt() -> bool | None:
            try:
                return all(r.ok for r in client.send_messages("orders", [Message(b) for b in bodies])) or None
            except ShardqError:
                return None  # not led yet

        wait_for(attempt, timeout=30, what=f"the batch to be acknowledged through {server}")


def in_sync(cluster: Cluster, server: str) -> None:
    wait_for(lambda: incarnations_of(cluster.leader_of(0)).get(server), timeout=15, what=f"{server} in sync")


@contextlib.contextmanager
def pair_holding(root: pathlib.Path, bodies: list[bytes]) -> Iterator[Cluster]:
    """s1 and s2 running, s1 leading, and `bodies` acknowledged and on both."""
    cluster = Cluster(root, placement=PAIR)
    with started(cluster):
        send_all(cluster, "s1", bodies)
        in_sync(cluster, "s2")
        yield cluster


def take_over_when_expired(cluster: Cluster, to: str, *, isr: list[str]) -> None:
    """As the operator fails a dead holder's shard over: once its lease expired."""

    def expired() -> LeaseRecord | None:
        lease = cluster.leader_of(0)
        return lease if is_expired(lease, now_ms()) else None

    lease = wait_for(expired, timeout=10, what="the dead leader's lease to expire")
    taken = build_takeover(lease, new_holder=to, now_ms=now_ms(), duration_ms=LEASE_MS)
    cluster.leases.update(build_isr_change(taken, isr))


def make_lease_anew(cluster: Cluster, *, holder: str, epoch: int) -> None:
    """The shard's Lease as one made anew would be, `epoch - 1` failovers later: `holder`
    holds it, both replicas in sync, no data vouched for."""
    fresh = build_initial_lease(shard=ShardId("orders", 0), replicas=PAIR[0], now_ms=now_ms(), duration_ms=LEASE_MS)
    current = cluster.leader_of(0)
    cluster.leases.update(
        dataclasses.replace(fresh, holder=holder, transitions=epoch, name=current.name, version=current.version)
    )


def restart_under_a_lease_made_anew(cluster: Cluster, *, epoch: int) -> list[bytes]:
    """Both servers (stopped) started again under the Lease made anew in `epoch`, held by
    s1; the bodies s1 then acknowledged."""
    make_lease_anew(cluster, holder="s1", epoch=epoch)
    cluster.start("s1")
    cluster.start("s2")
    new = [f"new-{i}".encode() for i in range(3)]
    send_all(cluster, "s1", new)
    return new


def received_through(cluster: Cluster, server: str) -> list[bytes]:
    with Client(cluster.endpoint(server)) as client:

        def attempt() -> list[bytes] | None:
            try:
                got = client.receive_messages("orders", max_messages=10, wait_time_ms=1000)
            except ShardqError:
                return None  # still taking the lead
            return sorted(m.body for m in got) or None

        return wait_for(attempt, timeout=30, what=f"{server} to serve the queue")


@pytest.mark.timeout(180)
def test_a_leader_of_an_epoch_another_server_led_moves_above_it(tmp_path: pathlib.Path) -> None:
    old = [f"old-{i}".encode() for i in range(5)]
    with pair_holding(tmp_path, old) as cluster:
        # s2 leads alone in epoch 2 and takes sends only it holds.
        cluster.kill("s1")
        take_over_when_expired(cluster, "s2", isr=["s2"])
        send_all(cluster, "s2", [f"alone-{i}".encode() for i in range(3)])
        cluster.kill("s2")
        # The Lease is made anew, and after one failover s1 holds it in epoch 2: s2's epoch.
        new = restart_under_a_lease_made_anew(cluster, epoch=2)
        assert cluster.leader_of(0).transitions > 2, "s1 leads above the epoch s2 saw led by itself"
        # s2 copies s1's state whole, and is in sync as that new copy of the data.
        copied = wait_for(
            lambda: re.search(r"bootstrapped from s1's snapshot .*incarnation now (\w+)", cluster.log("s2")),
            timeout=15,
            what="s2 to copy s1's snapshot",
        )
        wait_for(
            lambda: incarnations_of(cluster.leader_of(0)).get("s2") == copied[1],
            timeout=15,
            what="the lease to vouch for s2's copy",
        )
        # s2 is a copy of s1: it serves what s1 acknowledged, and not the sends of its own
        # epoch 2, which the Lease made anew left out (a batch s1 wrote in epoch 2 before
        # s2 told it, answered as not known to be stored and sent again, may be there twice).
        cluster.kill("s1")
        take_over_when_expired(cluster, "s2", isr=["s2"])
        assert set(received_through(cluster, "s2")) == set(old + new)
    assert "was led by s2, not s1" in cluster.log("s1")


@pytest.mark.timeout(180)
def test_a_holder_whose_data_saw_a_later_epoch_than_its_lease_leads(tmp_path: pathlib.Path) -> None:
    old = [f"old-{i}".encode() for i in range(5)]
    with pair_holding(tmp_path, old) as cluster:
        # s1 takes its own lease over twice (a restart each, as it were): epoch 3.
        for step in range(2):
            lease = cluster.leader_of(0)
            taken = cluster.leases.update(build_takeover(lease, new_holder="s1", now_ms=now_ms(), duration_ms=LEASE_MS))
            wait_for(
                lambda epoch=taken.transitions: f"leading at epoch {epoch}" in cluster.log("s1"),
                timeout=15,
                what="s1 to lead in the new epoch",
            )
            old.append(f"step-{step}".encode())
            send_all(cluster, "s1", old[-1:])
        epoch = cluster.leader_of(0).transitions
        assert epoch == 3
        in_sync(cluster, "s2")
        cluster.kill("s1")
        cluster.kill("s2")
        # The Lease is made anew: epoch 1, below what both replicas saw.
        new = restart_under_a_lease_made_anew(cluster, epoch=1)
        assert cluster.leader_of(0).transitions > epoch
        assert received_through(cluster, "s1") == sorted(old + new)


@pytest.mark.timeout(180)
def test_a_holder_whose_data_saw_its_leases_epoch_led_by_another_leads_above_it(tmp_path: pathlib.Path) -> None:
    old = [f"old-{i}".encode() for i in range(4)]  # with the rest, the 10 one receive takes
    with pair_holding(tmp_path, old) as cluster:
        # Leadership moves to s2 in epoch 2 while s1 runs: s1 follows s2 through epoch 2
        # and takes s2's sends, so its data records epoch 2 as s2's.
        lease = cluster.leader_of(0)
        cluster.leases.update(build_takeover(lease, new_holder="s2", now_ms=now_ms(), duration_ms=LEASE_MS))
        wait_for(lambda: "leading at epoch 2" in cluster.log("s2"), timeout=15, what="s2 to lead epoch 2")
        second = [f"second-{i}".encode() for i in range(3)]
        send_all(cluster, "s2", second)
        # In the ISR once they are acknowledged: s1 holds them, appended in s2's epoch 2.
        wait_for(lambda: "s1" in isr_of(cluster.leader_of(0)), timeout=15, what="s1 in s2's ISR")
        assert "stepping down: s2 leads at epoch 2" in cluster.log("s1") or "held by s2 at epoch 2" in cluster.log("s1")
        cluster.kill("s1")
        cluster.kill("s2")
        # The Lease is made anew with s1 holding epoch 2: an epoch s1's own data saw led
        # by s2. s1 raises the lease before it leads, so no entry of s1's is ever written
        # in s2's epoch: s2 follows on without being told of a second leader of epoch 2,
        # and needs no copy of s1's state.
        new = restart_under_a_lease_made_anew(cluster, epoch=2)
        assert cluster.leader_of(0).transitions > 2
        assert received_through(cluster, "s1") == sorted(old + second + new)
        in_sync(cluster, "s2")
    assert "leading at epoch 2" not in cluster.log("s1"), "s1 led the epoch its data saw s2 lead"
    assert "bootstrapped from" not in cluster.log("s2"), "s2 was told of two leaders of one epoch"
