"""A follower's log refuses an epoch it has seen led by another server, as it refuses an
older epoch: two leaders of one epoch only exist when the Leases were made anew below the
epochs the data carries, and their entries would then match by index and epoch (the
follower skipped the new leader's entry as one it already held, and kept the old one).
Real LMDB environments."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from shard_server.storage import replica_log
from shard_server.storage.codecs import encode_entry
from shard_server.storage.lmdb_store import ShardEnvironment


@pytest.fixture
def environment(tmp_path: pathlib.Path) -> Iterator[ShardEnvironment]:
    opened = ShardEnvironment(tmp_path / "shard", queue="orders", shard=0, map_size=1 << 24)
    yield opened
    opened.close()


def append(
    environment: ShardEnvironment, *, epoch: int, leader: str, index: int, prev_epoch: int | None = None
) -> replica_log.AppendOutcome:
    """One empty entry at `index`, after one of `prev_epoch` (the same epoch by default)."""
    entry = encode_entry(epoch=epoch, index=index, at_ms=1, encoded_events=[])
    return replica_log.append_as_follower(
        environment,
        epoch=epoch,
        leader=leader,
        prev_index=index - 1,
        prev_epoch=(epoch if prev_epoch is None else prev_epoch) if index > 1 else 0,
        entries=[entry],
        commit_index=0,
        fifo=False,
    )


def test_an_epoch_seen_led_by_one_server_is_refused_to_another(environment: ShardEnvironment) -> None:
    assert append(environment, epoch=3, leader="s2", index=1).result is replica_log.AppendResult.OK
    assert replica_log.epoch_seen(environment) == (3, "s2")
    refused = append(environment, epoch=3, leader="s1", index=2)
    assert refused.result is replica_log.AppendResult.STALE_EPOCH
    assert refused.epoch == 3
    assert "led by s2" in refused.detail
    assert replica_log.replica_indexes(environment)[2] == 1, "nothing of the refused append was kept"


def test_the_same_leader_goes_on_and_a_later_epoch_takes_over(environment: ShardEnvironment) -> None:
    assert append(environment, epoch=3, leader="s2", index=1).result is replica_log.AppendResult.OK
    assert append(environment, epoch=3, leader="s2", index=2).result is replica_log.AppendResult.OK
    assert append(environment, epoch=4, leader="s1", index=3, prev_epoch=3).result is replica_log.AppendResult.OK
    assert replica_log.epoch_seen(environment) == (4, "s1")
    stale = append(environment, epoch=3, leader="s2", index=4, prev_epoch=4)
    assert stale.result is replica_log.AppendResult.STALE_EPOCH


def test_a_leader_records_its_own_epoch_and_data_from_before_names_no_leader(environment: ShardEnvironment) -> None:
    assert replica_log.epoch_seen(environment) == (0, "")
    environment.set_epoch(5)  # as data written before the leader was recorded
    assert replica_log.epoch_seen(environment) == (5, "")
    # The first leader seen at that epoch is recorded, and then held to.
    assert append(environment, epoch=5, leader="s1", index=1).result is replica_log.AppendResult.OK
    assert replica_log.epoch_seen(environment) == (5, "s1")
    replica_log.set_epoch_seen(environment, 6, leader="s3")
    assert replica_log.epoch_seen(environment) == (6, "s3")
    replica_log.set_epoch_seen(environment, 6, leader="s1")  # not above: changes nothing
    assert replica_log.epoch_seen(environment) == (6, "s3")


def test_after_a_second_leader_of_its_epoch_the_replica_copies_its_next_leader_whole(
    environment: ShardEnvironment,
) -> None:
    assert append(environment, epoch=3, leader="s2", index=1).result is replica_log.AppendResult.OK
    assert append(environment, epoch=3, leader="s1", index=2).result is replica_log.AppendResult.STALE_EPOCH
    # s1 moves above it; its log may hold entries of epoch 3 that match this one's by
    # index and epoch, so matching is not trusted: a snapshot is.
    after = append(environment, epoch=4, leader="s1", index=2, prev_epoch=3)
    assert after.result is replica_log.AppendResult.NEEDS_SNAPSHOT
    assert "written by s2" in after.detail
    assert replica_log.replica_indexes(environment)[2] == 1
    # Leading (a new epoch of its own) ends it: its data is the reference from then on.
    replica_log.set_epoch_seen(environment, 5, leader="s2")
    assert append(environment, epoch=6, leader="s1", index=2, prev_epoch=3).result is replica_log.AppendResult.OK
