"""Operator replicas and their leader Lease (a real local lease store): one acts at a
time; another takes over once the leader stops renewing; a deposed leader stops."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest
from shardq_operator.leadership import OperatorLeadership

from shardq.coordination.local_leases import LocalLeaseStore

DURATION_MS = 400


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[LocalLeaseStore]:
    with LocalLeaseStore(tmp_path / "leases") as leases:
        yield leases


def test_one_replica_leads_and_the_other_stands_by(store: LocalLeaseStore) -> None:
    first = OperatorLeadership(store, identity="op-a", duration_ms=DURATION_MS)
    second = OperatorLeadership(store, identity="op-b", duration_ms=DURATION_MS)
    assert first.leading()
    for _ in range(5):
        assert not second.leading()
        assert first.leading()
        time.sleep(DURATION_MS / 4000)
    lease = store.get("shardq-operator")
    assert lease is not None
    assert lease.holder == "op-a"
    assert lease.transitions == 1


def test_a_silent_leader_is_replaced_and_then_stops_acting(store: LocalLeaseStore) -> None:
    first = OperatorLeadership(store, identity="op-a", duration_ms=DURATION_MS)
    second = OperatorLeadership(store, identity="op-b", duration_ms=DURATION_MS)
    assert first.leading()
    assert not second.leading()
    # op-a stops renewing (killed, hung): it stops acting before its lease expires for others...
    deadline = time.monotonic() + 2
    while first._serving_until_ms > time.monotonic_ns() // 1_000_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    # ...and op-b takes over once the lease has expired, in a new epoch.
    taken_over = time.monotonic() + 2
    while not second.leading():
        assert time.monotonic() < taken_over, "op-b never took over"
        time.sleep(0.02)
    lease = store.get("shardq-operator")
    assert lease is not None
    assert (lease.holder, lease.transitions) == ("op-b", 2)
    assert not first.leading()  # it comes back: the lease is op-b's now


def test_a_leader_keeps_its_lease_while_its_handlers_are_busy(store: LocalLeaseStore) -> None:
    """Renewal does not wait for a handler to ask: a reconcile pass longer than the lease
    (nobody calls leading() meanwhile) does not hand the operator to the standby."""
    first = OperatorLeadership(store, identity="op-a", duration_ms=DURATION_MS)
    second = OperatorLeadership(store, identity="op-b", duration_ms=DURATION_MS)
    assert first.leading()
    renewer = first.keep_renewing()
    try:
        deadline = time.monotonic() + 4 * DURATION_MS / 1000
        while time.monotonic() < deadline:
            assert not second.leading()
            time.sleep(DURATION_MS / 4000)
        lease = store.get("shardq-operator")
        assert lease is not None
        assert (lease.holder, lease.transitions) == ("op-a", 1)
    finally:
        first.stop_renewing()
        renewer.join(timeout=5)
    assert not renewer.is_alive()
    # Once it stops renewing (stopped, hung), the standby takes over as before.
    taken_over = time.monotonic() + 3
    while not second.leading():
        assert time.monotonic() < taken_over, "op-b never took over"
        time.sleep(0.02)
