"""The follower's side of log replication, on a shard's LMDB environment.

Followers persist entries before acknowledging them but apply them only once
the leader reports them committed, so an uncommitted tail from a fenced
leader can be cut off without undoing any state. A replica that has *applied*
an entry the new leader does not have (an old leader coming back) cannot be
repaired by truncation; it is told to bootstrap from a snapshot instead.
Every function here runs on the shard's writer thread.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import shutil

from shard_server.domain.applying import apply_event
from shard_server.storage import keys
from shard_server.storage.codecs import decode_entry_head
from shard_server.storage.lmdb_store import LmdbShardTransaction, ShardEnvironment


class AppendResult(enum.Enum):
    OK = "ok"
    STALE_EPOCH = "stale_epoch"
    MISMATCH = "mismatch"
    NEEDS_SNAPSHOT = "needs_snapshot"


@dataclasses.dataclass(frozen=True, slots=True)
class AppendOutcome:
    result: AppendResult
    epoch: int
    last_index: int
    detail: str = ""


def _meta(tx: LmdbShardTransaction, name: bytes) -> int:
    return tx.meta_int(name)


def _put_meta(tx: LmdbShardTransaction, name: bytes, value: int) -> None:
    tx.txn.put(name, keys.U64.pack(value), db=tx._meta)


def _epoch_leader(tx: LmdbShardTransaction) -> str:
    value = tx.txn.get(keys.META_EPOCH_LEADER, None, tx._meta)
    return "" if value is None else bytes(value).decode()


def _see_epoch(tx: LmdbShardTransaction, epoch: int, leader: str) -> None:
    _put_meta(tx, keys.META_EPOCH, epoch)
    tx.txn.put(keys.META_EPOCH_LEADER, leader.encode(), db=tx._meta)
    tx.txn.delete(keys.META_EPOCH_CONFLICT, db=tx._meta)


def entry_epoch(tx: LmdbShardTransaction, index: int) -> int | None:
    data = tx.txn.get(keys.U64.pack(index), db=tx._log)
    return None if data is None else decode_entry_head(data)[0]


def _truncate_after(tx: LmdbShardTransaction, index: int) -> None:
    """Drop every log entry above `index` (never applied ones: callers check)."""
    cursor = tx.txn.cursor(db=tx._log)
    cursor.set_range(keys.U64.pack(index + 1))
    while bytes(cursor.key()):
        cursor.delete()
    _put_meta(tx, keys.META_LAST_INDEX, index)


def apply_committed(tx: LmdbShardTransaction, *, up_to: int, fifo: bool) -> int:
    """Apply persisted entries (applied, up_to] in order; returns the new applied index."""
    applied = _meta(tx, keys.META_APPLIED_INDEX)
    target = min(up_to, tx.last_index())
    if target <= applied:
        return applied
    for entry in tx.iter_log(from_index=applied + 1, to_index=target + 1):
        for event in entry.events:
            apply_event(tx, event, fifo=fifo, now_ms=entry.at_ms)
        applied = entry.index
    _put_meta(tx, keys.META_APPLIED_INDEX, applied)
    tx.flush_meta()
    return applied


def append_as_follower(
    environment: ShardEnvironment,
    *,
    epoch: int,
    leader: str,
    prev_index: int,
    prev_epoch: int,
    entries: list[bytes],
    commit_index: int,
    fifo: bool,
) -> AppendOutcome:
    with environment.write_transaction() as tx:
        seen = _meta(tx, keys.META_EPOCH)
        if epoch < seen:
            return AppendOutcome(AppendResult.STALE_EPOCH, seen, tx.last_index(), f"epoch {epoch} < {seen}")
        led_by = _epoch_leader(tx)
        if epoch == seen and led_by and led_by != leader:
            # One lease gives each epoch one holder: two leaders of one epoch means the
            # Leases were made anew below the epochs the data carries, and entries of
            # both terms would match by index and epoch. The leader moves above it, and
            # this replica then copies its state whole: the entries it may have written
            # at this epoch before it heard cannot be told from this replica's own.
            tx.txn.put(keys.META_EPOCH_CONFLICT, b"1", db=tx._meta)
            return AppendOutcome(
                AppendResult.STALE_EPOCH, seen, tx.last_index(), f"epoch {epoch} was led by {led_by}, not {leader}"
            )
        if epoch > seen and tx.txn.get(keys.META_EPOCH_CONFLICT, None, tx._meta) is not None:
            return AppendOutcome(
                AppendResult.NEEDS_SNAPSHOT,
                epoch,
                tx.last_index(),
                f"this replica's entries of epoch {seen} were written by {led_by}, another leader of that epoch",
            )
        if epoch > seen or not led_by:
            _see_epoch(tx, epoch, leader)
        last = tx.last_index()
        applied = _meta(tx, keys.META_APPLIED_INDEX)
        if prev_index > 0 and prev_epoch == 0:
            # The leader no longer holds the entries before prev_index + 1.
            if last < prev_index:
                return AppendOutcome(AppendResult.NEEDS_SNAPSHOT, epoch, last, "behind the leader's log start")
        elif prev_index > last:
            return AppendOutcome(AppendResult.MISMATCH, epoch, last, "gap before the entries")
        elif prev_index > 0:
            local = entry_epoch(tx, prev_index)
            if local != prev_epoch:
                if prev_index <= applied:
                    return AppendOutcome(AppendResult.NEEDS_SNAPSHOT, epoch, last, "applied a divergent entry")
                _truncate_after(tx, prev_index - 1)
                return AppendOutcome(AppendResult.MISMATCH, epoch, prev_index - 1, "divergent entry cut off")
        index = prev_index
        for data in entries:
            index += 1
            entry_epoch_sent, entry_index, _, _ = decode_entry_head(data)
            if entry_index != index:
                return AppendOutcome(AppendResult.MISMATCH, epoch, tx.last_index(), "entries out of order")
            if index <= tx.last_index():
                if entry_epoch(tx, index) == entry_epoch_sent:
                    continue  # already have it (a retried append)
                if index <= applied:
                    return AppendOutcome(
                        AppendResult.NEEDS_SNAPSHOT, epoch, tx.last_index(), "applied a divergent entry"
                    )
                _truncate_after(tx, index - 1)
            tx.txn.put(keys.U64.pack(index), data, db=tx._log, append=True)
            _put_meta(tx, keys.META_LAST_INDEX, index)
        apply_committed(tx, up_to=commit_index, fifo=fifo)
        return AppendOutcome(AppendResult.OK, epoch, tx.last_index())


def read_entries(environment: ShardEnvironment, *, from_index: int, max_entries: int, max_bytes: int) -> list[bytes]:
    found: list[bytes] = []
    size = 0
    with environment.read() as tx:
        cursor = tx.txn.cursor(db=tx._log)
        positioned = cursor.set_range(keys.U64.pack(from_index))
        expected = from_index
        while positioned and len(found) < max_entries and size < max_bytes:
            if keys.U64.unpack(cursor.key())[0] != expected:
                break
            value = bytes(cursor.value())
            found.append(value)
            size += len(value)
            expected += 1
            positioned = cursor.next()
    return found


def replica_indexes(environment: ShardEnvironment) -> tuple[int, int, int, int]:
    """(epoch seen, first log index, last log index, applied index)."""
    with environment.read() as tx:
        return (
            _meta(tx, keys.META_EPOCH),
            tx.first_log_index(),
            tx.last_index(),
            _meta(tx, keys.META_APPLIED_INDEX),
        )


def entry_epoch_at(environment: ShardEnvironment, index: int) -> int | None:
    with environment.read() as tx:
        return entry_epoch(tx, index)


def set_epoch_seen(environment: ShardEnvironment, epoch: int, *, leader: str) -> None:
    """Record that `leader` leads `epoch` (when it is above the epoch seen so far)."""
    with environment.write_transaction() as tx:
        if epoch > _meta(tx, keys.META_EPOCH):
            _see_epoch(tx, epoch, leader)


def epoch_seen(environment: ShardEnvironment) -> tuple[int, str]:
    """The highest epoch this replica has seen, and who led it ("" when not recorded:
    data written before the leader was)."""
    with environment.read() as tx:
        return _meta(tx, keys.META_EPOCH), _epoch_leader(tx)


def recover_committed_ahead(environment: ShardEnvironment, *, fifo: bool) -> int:
    """Apply the batches written ahead that LMDB lacks; returns the last index applied, or 0.

    A standalone shard answers a batch once its entry is in the commit-ahead file, and
    LMDB makes each commit's meta page durable only with the next commit (see
    storage.commit_ahead): after a crash LMDB may end up to two entries short. They are
    appended and applied here, in order, as a follower applies replicated entries, before
    the shard serves again. Records LMDB holds already (the usual case) are left alone.
    """
    found = {decode_entry_head(entry)[1]: entry for entry in environment.committed_ahead()}
    if not found:
        return 0
    recovered = 0
    with environment.write_transaction() as tx:
        seen = _meta(tx, keys.META_EPOCH)
        while True:
            last = tx.last_index()
            entry = found.get(last + 1)
            if entry is None or decode_entry_head(entry)[0] < seen or _meta(tx, keys.META_APPLIED_INDEX) != last:
                break
            tx.txn.put(keys.U64.pack(last + 1), entry, db=tx._log, append=True)
            _put_meta(tx, keys.META_LAST_INDEX, last + 1)
            apply_committed(tx, up_to=last + 1, fifo=fifo)
            recovered = last + 1
    return recovered


def apply_whole_log(environment: ShardEnvironment, *, fifo: bool) -> int:
    """A new leader first applies every entry it holds: they may become committed."""
    with environment.write_transaction() as tx:
        return apply_committed(tx, up_to=tx.last_index(), fifo=fifo)


def snapshot_to(environment: ShardEnvironment, directory: pathlib.Path) -> tuple[pathlib.Path, int]:
    """A compacted copy of the environment in `directory`; returns (data file, last index)."""
    with environment.read() as tx:
        last = tx.last_index()
    environment.copy_to(directory)
    return directory / "data.mdb", last


def install_snapshot(shard_directory: pathlib.Path, data_file: pathlib.Path) -> None:
    """Replace a (closed) shard environment's files with a snapshot's data file.

    The leader's copy carries its own meta (applied index = last index), so the
    replica resumes from exactly the state the snapshot holds.
    """
    staging = shard_directory.with_name(shard_directory.name + ".incoming")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    shutil.move(str(data_file), staging / "data.mdb")
    retired = shard_directory.with_name(shard_directory.name + ".retired")
    if retired.exists():
        shutil.rmtree(retired)
    os.replace(shard_directory, retired)
    os.replace(staging, shard_directory)
    shutil.rmtree(retired)
