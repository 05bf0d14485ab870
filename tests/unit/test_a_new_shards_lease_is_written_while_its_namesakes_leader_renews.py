"""A queue made again under a deleted one's name takes over the shard leases the old
creation left, while the old creation's leaders still renew them. The write of the next
epoch must survive a renewal landing between its read and its write (the project's CI
once failed on exactly that: `LeaseConflict: lease 'orders.0' changed since version 3`).

The store is the real local lease store. The renewal is a real write to it, made by the
same code a leader runs (`build_renewal`), timed between the read and the write by a
wrapper around `get`: a race that real runs hit once in a thousand tests, made certain.
"""

from __future__ import annotations

import builtins
import pathlib

import pytest

from shardq.coordination.fencing import build_renewal
from shardq.coordination.leases import QUEUE_UID_ANNOTATION, LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.coordination.new_shard_leases import NEW_SHARD_LEASE_ATTEMPTS, write_lease_for_new_shard
from shardq.coordination.placement import ShardId

SHARD = ShardId("orders", 0)
DURATION_MS = 1_500


class RenewedAfterEachRead:
    """The real store, with the old creation's leader renewing the lease right after each
    of the first `renewals` reads of it."""

    def __init__(self, store: LeaseStore, renewals: int) -> None:
        self.store = store
        self.renewals_left = renewals
        self.clock_ms = 1_000_000

    def get(self, name: str) -> LeaseRecord | None:
        read = self.store.get(name)
        if read is not None and self.renewals_left > 0:
            self.renewals_left -= 1
            self.clock_ms += 1
            self.store.update(build_renewal(read, now_ms=self.clock_ms))
        return read

    def create(self, record: LeaseRecord) -> LeaseRecord:
        return self.store.create(record)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        return self.store.update(record)

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        return self.store.list(prefix)


def old_creations_lease(store: LeaseStore) -> LeaseRecord:
    return write_lease_for_new_shard(
        store, shard=SHARD, replicas=["s1", "s2"], now_ms=lambda: 1_000_000, duration_ms=DURATION_MS, queue_uid="c-1"
    )


def test_the_next_epoch_is_written_after_a_renewal_between_its_read_and_its_write(tmp_path: pathlib.Path) -> None:
    store = LocalLeaseStore(tmp_path / "leases")
    old = old_creations_lease(store)
    renewing = RenewedAfterEachRead(store, renewals=NEW_SHARD_LEASE_ATTEMPTS - 1)

    written = write_lease_for_new_shard(
        renewing, shard=SHARD, replicas=["s2", "s1"], now_ms=lambda: 2_000_000, duration_ms=DURATION_MS, queue_uid="c-2"
    )

    assert renewing.renewals_left == 0, "every renewal landed between a read and a write"
    stored = store.get(old.name)
    assert stored is not None
    assert stored == written
    # Exactly the next epoch after the old creation's, however many renewals came between:
    # a renewal keeps the epoch, so receipts of the old queue never match the new one.
    assert stored.transitions == old.transitions + 1
    assert stored.holder == "s2"
    assert stored.annotations[QUEUE_UID_ANNOTATION] == "c-2"


def test_a_lease_that_moves_on_every_read_is_reported_not_raced_forever(tmp_path: pathlib.Path) -> None:
    store = LocalLeaseStore(tmp_path / "leases")
    old = old_creations_lease(store)
    renewing = RenewedAfterEachRead(store, renewals=NEW_SHARD_LEASE_ATTEMPTS)

    with pytest.raises(LeaseConflict, match="orders"):
        write_lease_for_new_shard(
            renewing,
            shard=SHARD,
            replicas=["s2", "s1"],
            now_ms=lambda: 2_000_000,
            duration_ms=DURATION_MS,
            queue_uid="c-2",
        )
    stored = store.get(old.name)
    assert stored is not None
    assert stored.transitions == old.transitions, "no epoch was written"
    assert stored.annotations[QUEUE_UID_ANNOTATION] == "c-1"
