"""One LMDB environment per shard replica, and the ShardStore over one transaction.

A write transaction holds one batch of requests (group commit): their effects
and the log entry recording them are committed together, durably (a standalone
shard's entry is written ahead first: storage.commit_ahead). LMDB write
transactions belong to the thread that opened them, so a batch begun on a thread
(`ShardEnvironment.begin_batch`) is committed on that thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import lmdb

from shard_server.domain.events import DeliveryChanged, Event, LogEntry, Sent
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord
from shard_server.storage import commit_ahead as commit_ahead_file
from shard_server.storage import keys
from shard_server.storage.closing_gate import CloseGate, EnvironmentClosed
from shard_server.storage.codecs import (
    decode_delivery,
    decode_entry,
    decode_entry_head,
    decode_record,
    encode_delivery,
    encode_delivery_changed,
    encode_entry,
    encode_event,
    encode_record,
    encode_sent,
)
from shard_server.storage.commit_ahead import CommitAheadFile

T = TypeVar("T")

DEFAULT_MAP_SIZE = 64 << 30
# Index values say whether the message is claimed, so counting in-flight and
# delayed messages reads the index alone.
_INDEX_READY = b"\0"
_INDEX_CLAIMED = b"\1"
# Read once: an enum member read from its class costs about 60 ns, on every claim.
_CLAIMED = DeliveryState.CLAIMED
_DEAD_LETTER_PENDING = DeliveryState.DEAD_LETTER_PENDING


class IdentityMismatch(RuntimeError):
    """The data directory holds another queue's or shard's data."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardStats:
    messages: int
    visible: int
    in_flight: int
    delayed: int
    dead_letter_pending: int
    oldest_sent_at_ms: int
    last_index: int
    epoch: int
    map_used_bytes: int
    map_size_bytes: int


def let_lmdb_calls_release_the_gil() -> None:
    """Ask py-lmdb to release the GIL in every call (process-wide), not only in `commit()`.

    py-lmdb 3 releases the GIL inside `commit()`, fsync included, even unasked:
    during a 200 ms commit another Python thread kept running (bench/LATENCY.md).
    This asks the same of its other calls (gets, puts, cursors). One
    writer thread gained nothing from it (measured); several writer threads may
    need it for their LMDB work to overlap.
    """
    enable = getattr(lmdb, "enable_drop_gil", None)
    if enable is not None:
        enable()


class ShardEnvironment:
    def __init__(
        self,
        path: pathlib.Path,
        *,
        queue: str,
        shard: int,
        map_size: int = DEFAULT_MAP_SIZE,
        commit_ahead: bool = False,
    ) -> None:
        """`commit_ahead`: batches' entries are written ahead and LMDB skips its meta sync
        (storage.commit_ahead); standalone shards only, as replicated ones send followers
        what LMDB holds."""
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.gate = CloseGate(f"queue {queue!r} shard {shard}")
        self.commits_ahead = commit_ahead
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=len(keys.ALL_DBS),
            max_readers=512,
            # Read transactions are used from executor threads and generators.
            lock=True,
            sync=True,
            # Committing ahead, a commit's meta page becomes durable with the next commit's
            # sync; the commit-ahead file holds what that leaves undone, and transactions
            # not written ahead are synced when they commit (see _transaction).
            metasync=not commit_ahead,
        )
        self.dbs = {name: self.env.open_db(name) for name in keys.ALL_DBS}
        identity = json.dumps({"queue": queue, "shard": shard}).encode()
        with self.env.begin(write=True) as txn:
            stored = txn.get(keys.META_IDENTITY, db=self.dbs[keys.DB_META])
            if stored is None:
                txn.put(keys.META_IDENTITY, identity, db=self.dbs[keys.DB_META])
            elif stored != identity:
                raise IdentityMismatch(f"{path} holds {stored.decode()}, not queue {queue!r} shard {shard}")
            if txn.get(keys.META_INCARNATION, db=self.dbs[keys.DB_META]) is None:
                txn.put(keys.META_INCARNATION, os.urandom(6).hex().encode(), db=self.dbs[keys.DB_META])
        # Opened without committing ahead too, if there: it may hold batches LMDB lacks.
        self._ahead: CommitAheadFile | None = None
        if commit_ahead or (path / commit_ahead_file.FILE_NAME).exists():
            self._ahead = CommitAheadFile(path, create=commit_ahead)
        self._incarnation = self.incarnation()

    def close(self) -> None:
        """Close once every thread using the environment has left it (see closing_gate)."""

        def close_files() -> None:
            if self.commits_ahead:
                # The last commit's meta page is not synced yet: after a clean stop LMDB's
                # files alone hold every batch, with no need of the commit-ahead file.
                self.env.sync(True)
            self.env.close()
            if self._ahead is not None:
                self._ahead.close()

        self.gate.close(close_files)

    def write(self, work: Callable[[LmdbShardTransaction], T], *, epoch: int, at_ms: int) -> tuple[T, int]:
        """Run `work` in one write transaction and commit it durably with its log entry.

        Returns the work's result and the log index written (0 if no events).
        """
        batch = self.begin_batch(work, epoch=epoch, at_ms=at_ms)
        batch.commit()
        return batch.result, batch.index

    def begin_batch(
        self,
        work: Callable[[LmdbShardTransaction], T],
        *,
        epoch: int,
        at_ms: int,
        write_ahead_if: Callable[[int], bool] | None = None,
    ) -> OpenBatch[T]:
        """Run `work` in a write transaction, add its log entry, and leave it to commit.

        Committing ahead, an entry that fits the commit-ahead file is written there first
        (`written_ahead`), unless `write_ahead_if`, asked after the work with the entry's
        size in bytes, says not to: the batch counts as written from then on, and may be
        answered before its commit, even if LMDB's commit then fails (reopening the shard
        recovers it). Otherwise the batch is durable once committed. The caller commits
        on the thread that called this (LMDB write transactions belong to their thread).
        """
        self.gate.enter()
        try:
            txn = self.env.begin(write=True)
        except BaseException:
            self.gate.leave()
            raise
        try:
            tx = LmdbShardTransaction(txn, self.dbs)
            result = work(tx)
            index = tx.write_log_entry(epoch=epoch, at_ms=at_ms)
            entry = tx.written_entry
            ahead = self._ahead if self.commits_ahead else None
            written_ahead_at = None
            if (
                ahead is not None
                and entry is not None
                and ahead.fits(len(entry))
                and (write_ahead_if is None or write_ahead_if(len(entry)))
            ):
                ahead.write(entry, index=index, incarnation=self._incarnation)
                written_ahead_at = time.perf_counter()
        except BaseException:
            txn.abort()
            self.gate.leave()
            raise
        return OpenBatch(self, txn, result, index, written_ahead_at=written_ahead_at)

    def committed_ahead(self) -> list[bytes]:
        """The entries written ahead for this copy of the data (LMDB may hold them already)."""
        return [] if self._ahead is None else self._ahead.read(incarnation=self._incarnation)

    @contextmanager
    def write_transaction(self) -> Iterator[LmdbShardTransaction]:
        """A raw write transaction (replica log appends); committed, durably, when the block ends cleanly."""
        with self._transaction() as tx:
            yield tx

    @contextmanager
    def _transaction(self) -> Iterator[LmdbShardTransaction]:
        """A write transaction, durable once committed."""
        with self.gate.entered():
            with self.env.begin(write=True) as txn:
                txn_id = txn.id()
                yield LmdbShardTransaction(txn, self.dbs)
            self.sync_if_committed(txn_id)

    def sync_if_committed(self, txn_id: int) -> None:
        """Make transaction `txn_id`, just committed without being written ahead, durable:
        LMDB's meta page is not synced when committing ahead."""
        # LMDB commits an empty transaction without writing: its id is then not the last.
        if self.commits_ahead and self.env.info()["last_txnid"] == txn_id:
            self.env.sync(True)

    @contextmanager
    def read(self) -> Iterator[LmdbShardTransaction]:
        """A read transaction for one thread and one uninterrupted piece of work.

        Never hold it across an `await` or hand its cursors to another thread:
        a stream that reads in batches opens one per batch, or holds one with
        `hold_read`.
        """
        with self.gate.entered(), self.env.begin(write=False, buffers=False) as txn:
            yield LmdbShardTransaction(txn, self.dbs)

    def hold_read(self) -> HeldRead:
        """One read transaction kept across the batches of a stream (a consistent snapshot)."""
        return HeldRead(self)

    def incarnation(self) -> str:
        """Which copy of the shard's data this is (new when created empty or from a snapshot)."""
        with self.read() as tx:
            value = tx.txn.get(keys.META_INCARNATION, db=self.dbs[keys.DB_META])
        return "" if value is None else bytes(value).decode()

    def renew_incarnation(self) -> str:
        incarnation = os.urandom(6).hex()
        with self.write_transaction() as tx:
            tx.txn.put(keys.META_INCARNATION, incarnation.encode(), db=self.dbs[keys.DB_META])
        self._incarnation = incarnation
        return incarnation

    def epoch(self) -> int:
        with self.read() as tx:
            return tx.meta_int(keys.META_EPOCH)

    def set_epoch(self, epoch: int) -> None:
        with self.write_transaction() as tx:
            tx.txn.put(keys.META_EPOCH, keys.U64.pack(epoch), db=self.dbs[keys.DB_META])

    def stats(self, *, now_ms: int) -> ShardStats:
        with self.read() as tx:
            return tx.stats(now_ms=now_ms, map_size=self.env.info()["map_size"])

    def copy_to(self, destination: pathlib.Path) -> None:
        """A consistent, compacted copy of the whole shard (bootstrap and backup)."""
        destination.mkdir(parents=True, exist_ok=True)
        with self.gate.entered():
            self.env.copy(str(destination), compact=True)


class OpenBatch(Generic[T]):
    """A batch's write transaction with its work done and its log entry added, not yet
    committed (ShardEnvironment.begin_batch); committed or aborted exactly once, on the
    thread that began it."""

    def __init__(
        self,
        environment: ShardEnvironment,
        txn: lmdb.Transaction,
        result: T,
        index: int,
        *,
        written_ahead_at: float | None,
    ) -> None:
        self._environment = environment
        self._txn = txn
        self.result = result
        # The log index written (0 if no events).
        self.index = index
        # When the entry was written ahead (time.perf_counter), if it was: durable since.
        self.written_ahead_at = written_ahead_at

    @property
    def written_ahead(self) -> bool:
        return self.written_ahead_at is not None

    def commit(self) -> None:
        """Commit to LMDB: durable when this returns (raises if LMDB's commit failed)."""
        try:
            txn_id = self._txn.id()
            self._txn.commit()
            if not self.written_ahead:
                self._environment.sync_if_committed(txn_id)
        finally:
            self._environment.gate.leave()


class HeldRead:
    """A read transaction that outlives one call: used by one thread at a time, closed exactly once.

    A stream reads it batch by batch from worker threads; the stream may be
    cancelled, or the environment closed, while a worker is inside. `release`
    never waits: if a batch is running, that batch's thread closes the
    transaction when it finishes, so no cursor is freed under a running thread.
    """

    _tokens = itertools.count()

    def __init__(self, environment: ShardEnvironment) -> None:
        self._gate = environment.gate
        self._token = next(self._tokens)
        self._lock = threading.Lock()
        self._release_requested = False
        self._released = False
        self._gate.enter()
        try:
            self._txn = environment.env.begin(write=False, buffers=False)
        except BaseException:
            self._gate.leave()
            raise
        self.tx = LmdbShardTransaction(self._txn, environment.dbs)
        self._gate.hold(self._token, self.release)

    def run(self, work: Callable[[LmdbShardTransaction], T]) -> T:
        """Run `work` on the held transaction (in the calling thread)."""
        with self._lock:
            if self._released:
                raise EnvironmentClosed(self._gate.what)
            result = work(self.tx)
        if self._release_requested:
            self._release_if_idle()
        return result

    def release(self) -> None:
        """Close now if no batch runs, else as soon as the running one returns (any thread)."""
        self._release_requested = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the running batch sees the request when it returns
        try:
            if not self._released:
                self._released = True
                self._txn.abort()
                self._gate.unhold(self._token)
                self._gate.leave()
        finally:
            self._lock.release()


class LmdbShardTransaction:
    """ShardStore over one LMDB transaction (see shard_server.domain.store).

    py-lmdb's get, put and delete are called with positional arguments only: `get(key,
    None, db)`, `put(key, value, False, True, False, db)` (no duplicates, overwrite, not
    appending; `True` last appends) and `delete(key, b"", db)`. Its keyword parsing cost
    more than the LMDB call: a put took 497 ns with `db=` and 263 ns without, a get 267
    against 201, a delete 364 against 285 (measured; a claim makes five such calls).
    """

    def __init__(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database]) -> None:
        self.txn = txn
        self._messages = dbs[keys.DB_MESSAGES]
        self._delivery = dbs[keys.DB_DELIVERY]
        self._index = dbs[keys.DB_INDEX]
        self._priority_index = dbs[keys.DB_PRIORITY_INDEX]
        self._dead = dbs[keys.DB_DEAD_LETTERS]
        self._dedup = dbs[keys.DB_DEDUP]
        self._dedup_expiry = dbs[keys.DB_DEDUP_EXPIRY]
        self._groups = dbs[keys.DB_GROUPS]
        self._meta = dbs[keys.DB_META]
        self._log = dbs[keys.DB_LOG]
        self._events: list[bytes] = []
        # The log entry write_log_entry encoded, for committing it ahead (commit_ahead).
        self.written_entry: bytes | None = None
        self._last_seq: int | None = None
        # Written once per transaction (flush_meta), not once per message.
        self._last_seq_dirty = False
        # Encoded for their event, reused when the event is applied: records by seq,
        # and deliveries by seq with the very object encoded (applying may
        # substitute another state, e.g. a FIFO message waiting behind its group).
        self._encoded_records: dict[int, bytes] = {}
        self._encoded_deliveries: dict[int, tuple[Delivery, bytes]] = {}

    # -- meta --------------------------------------------------------------
    def meta_int(self, name: bytes) -> int:
        value = self.txn.get(name, None, self._meta)
        return 0 if value is None else int(keys.U64.unpack(value)[0])

    # -- reads -------------------------------------------------------------
    def get_record(self, seq: int) -> MessageRecord | None:
        data = self.txn.get(keys.seq_key(seq), None, self._messages)
        return None if data is None else decode_record(data)

    def get_delivery(self, seq: int) -> Delivery | None:
        data = self.txn.get(keys.seq_key(seq), None, self._delivery)
        return None if data is None else decode_delivery(seq, data)

    def eligible(self, now_ms: int, *, after: tuple[int, int] | None, limit: int) -> list[tuple[int, int]]:
        cursor = self.txn.cursor(db=self._index)
        found: list[tuple[int, int]] = []
        positioned = cursor.first() if after is None else cursor.set_range(keys.index_key(after[0], after[1] + 1))
        while positioned and len(found) < limit:
            key = keys.parse_index_key(cursor.key())
            if key[0] > now_ms:
                break
            found.append(key)
            positioned = cursor.next()
        return found

    def eligible_by_priority(
        self, now_ms: int, *, after: tuple[int, int, int] | None, limit: int
    ) -> list[tuple[int, int, int]]:
        cursor = self.txn.cursor(db=self._priority_index)
        found: list[tuple[int, int, int]] = []
        if after is None:
            positioned = cursor.first()
        else:
            positioned = cursor.set_range(keys.LANE_TRIPLE.pack(after[0], after[1], after[2] + 1))
        while positioned and len(found) < limit:
            key = keys.parse_priority_index_key(cursor.key())
            if key[1] > now_ms:
                # The rest of this lane waits too: on to the next lane down.
                positioned = key[0] < 255 and cursor.set_range(keys.LANE_TRIPLE.pack(key[0] + 1, 0, 0))
                continue
            found.append(key)
            positioned = cursor.next()
        return found

    def next_visible_at(self) -> int | None:
        """The earliest deadline or delay in the index: when a waiter should look again."""
        cursor = self.txn.cursor(db=self._index)
        if not cursor.first():
            return None
        return keys.parse_index_key(cursor.key())[0]

    def oldest_messages(self, *, after_seq: int, limit: int) -> list[tuple[int, int]]:
        cursor = self.txn.cursor(db=self._delivery)
        found: list[tuple[int, int]] = []
        positioned = cursor.set_range(keys.seq_key(after_seq + 1))
        while positioned and len(found) < limit:
            seq = keys.U64.unpack(cursor.key())[0]
            found.append((seq, decode_delivery(seq, cursor.value()).sent_at_ms))
            positioned = cursor.next()
        return found

    def message_count(self) -> int:
        return int(self.txn.stat(self._messages)["entries"])

    def last_seq(self) -> int:
        if self._last_seq is None:
            self._last_seq = self.meta_int(keys.META_LAST_SEQ)
        return self._last_seq

    def last_index(self) -> int:
        return self.meta_int(keys.META_LAST_INDEX)

    def dedup_lookup(self, dedup_id: str) -> tuple[int, int, int] | None:
        data = self.txn.get(dedup_id.encode(), None, self._dedup)
        if data is None:
            return None
        seq, sent_at, expires = keys.DEDUP_VALUE.unpack(data)
        return seq, sent_at, expires

    def first_group_member(self, group_id: str) -> int | None:
        prefix = keys.group_prefix(group_id)
        cursor = self.txn.cursor(db=self._groups)
        if not cursor.set_range(prefix):
            return None
        key = bytes(cursor.key())
        if not key.startswith(prefix) or len(key) != len(prefix) + 8:
            return None
        return int(keys.U64.unpack(key[len(prefix) :])[0])

    def dead_letter_pending(self, *, limit: int) -> list[int]:
        cursor = self.txn.cursor(db=self._dead)
        found: list[int] = []
        positioned = cursor.first()
        while positioned and len(found) < limit:
            found.append(int(keys.U64.unpack(cursor.key())[0]))
            positioned = cursor.next()
        return found

    def iter_messages(self) -> Iterator[tuple[MessageRecord, Delivery]]:
        """Every stored message in seq order (export snapshots)."""
        cursor = self.txn.cursor(db=self._messages)
        for key, value in cursor:
            seq = keys.U64.unpack(key)[0]
            delivery = self.get_delivery(seq)
            if delivery is not None:
                yield decode_record(value), delivery

    def iter_log(self, *, from_index: int, to_index: int) -> Iterator[LogEntry]:
        cursor = self.txn.cursor(db=self._log)
        positioned = cursor.set_range(keys.U64.pack(from_index))
        while positioned:
            index = keys.U64.unpack(cursor.key())[0]
            if index >= to_index:
                break
            yield decode_entry(cursor.value())
            positioned = cursor.next()

    def next_dedup_expiry(self) -> int | None:
        cursor = self.txn.cursor(db=self._dedup_expiry)
        if not cursor.first():
            return None
        return int(keys.U64.unpack(cursor.key()[:8])[0])

    def first_log_entry_at_ms(self) -> int | None:
        cursor = self.txn.cursor(db=self._log)
        if not cursor.first():
            return None
        return decode_entry_head(cursor.value())[2]

    def first_log_index(self) -> int:
        cursor = self.txn.cursor(db=self._log)
        if not cursor.first():
            return self.last_index() + 1
        return int(keys.U64.unpack(cursor.key())[0])

    def stats(self, *, now_ms: int, map_size: int) -> ShardStats:
        messages = self.message_count()
        dead = int(self.txn.stat(self._dead)["entries"])
        in_flight = delayed = 0
        cursor = self.txn.cursor(db=self._index)
        positioned = cursor.set_range(keys.index_key(now_ms + 1, 0))
        while positioned:
            if cursor.value() == _INDEX_CLAIMED:
                in_flight += 1
            else:
                delayed += 1
            positioned = cursor.next()
        first = self.oldest_messages(after_seq=0, limit=1)
        oldest = first[0][1] if first else 0
        used = sum(
            (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
            for stat in (
                self.txn.stat(db)
                for db in (self._messages, self._delivery, self._index, self._priority_index, self._log)
            )
        )
        return ShardStats(
            messages=messages,
            visible=max(messages - in_flight - delayed - dead, 0),
            in_flight=in_flight,
            delayed=delayed,
            dead_letter_pending=dead,
            oldest_sent_at_ms=oldest,
            last_index=self.last_index(),
            epoch=self.meta_int(keys.META_EPOCH),
            map_used_bytes=used,
            map_size_bytes=map_size,
        )

    # -- writes --------------------------------------------------------------
    def put_record(self, record: MessageRecord) -> None:
        encoded = self._encoded_records.pop(record.seq, None)
        if encoded is None:
            encoded = encode_record(record)
        self.txn.put(keys.seq_key(record.seq), encoded, False, True, False, self._messages)

    def delete_record(self, seq: int) -> None:
        self.txn.delete(keys.seq_key(seq), b"", self._messages)

    def _unlink(self, delivery: Delivery) -> None:
        if delivery.indexed:
            self.txn.delete(keys.index_key(delivery.visible_at_ms, delivery.seq), b"", self._index)
            if delivery.priority:
                key = keys.priority_index_key(delivery.priority, delivery.visible_at_ms, delivery.seq)
                self.txn.delete(key, b"", self._priority_index)
        elif delivery.state == _DEAD_LETTER_PENDING:
            self.txn.delete(keys.seq_key(delivery.seq), b"", self._dead)

    def put_delivery(self, delivery: Delivery, *, previous: Delivery | None) -> None:
        cached = self._encoded_deliveries.pop(delivery.seq, None)
        encoded = cached[1] if cached is not None and cached[0] is delivery else encode_delivery(delivery)
        self._write_delivery(delivery, encoded, previous)

    def _write_delivery(self, delivery: Delivery, encoded: bytes, previous: Delivery | None) -> None:
        if previous is not None:
            self._unlink(previous)
        seq = keys.seq_key(delivery.seq)
        self.txn.put(seq, encoded, False, True, False, self._delivery)
        if delivery.indexed:
            marker = _INDEX_CLAIMED if delivery.state == _CLAIMED else _INDEX_READY
            self.txn.put(keys.index_key(delivery.visible_at_ms, delivery.seq), marker, False, True, False, self._index)
            if delivery.priority:
                key = keys.priority_index_key(delivery.priority, delivery.visible_at_ms, delivery.seq)
                self.txn.put(key, marker, False, True, False, self._priority_index)
        elif delivery.state == _DEAD_LETTER_PENDING:
            self.txn.put(seq, b"", False, True, False, self._dead)

    def delete_delivery(self, delivery: Delivery) -> None:
        self._unlink(delivery)
        self.txn.delete(keys.seq_key(delivery.seq), b"", self._delivery)

    def put_dedup(self, dedup_id: str, *, seq: int, sent_at_ms: int, expires_at_ms: int) -> None:
        key = dedup_id.encode()
        old = self.txn.get(key, None, self._dedup)
        if old is not None:
            self.txn.delete(keys.dedup_expiry_key(keys.DEDUP_VALUE.unpack(old)[2], dedup_id), b"", self._dedup_expiry)
        self.txn.put(key, keys.DEDUP_VALUE.pack(seq, sent_at_ms, expires_at_ms), False, True, False, self._dedup)
        self.txn.put(keys.dedup_expiry_key(expires_at_ms, dedup_id), b"", False, True, False, self._dedup_expiry)

    def prune_dedup(self, *, up_to_ms: int) -> None:
        cursor = self.txn.cursor(db=self._dedup_expiry)
        cursor.first()
        # After a delete the cursor sits on the next key, or on none (empty key).
        while key := bytes(cursor.key()):
            if keys.U64.unpack(key[:8])[0] > up_to_ms:
                break
            self.txn.delete(key[8:], b"", self._dedup)
            cursor.delete()

    def add_group_member(self, group_id: str, seq: int) -> None:
        self.txn.put(keys.group_key(group_id, seq), b"", False, True, False, self._groups)

    def remove_group_member(self, group_id: str, seq: int) -> None:
        self.txn.delete(keys.group_key(group_id, seq), b"", self._groups)

    def set_last_seq(self, seq: int) -> None:
        self._last_seq = seq
        self._last_seq_dirty = True

    def flush_meta(self) -> None:
        """Write what was kept in memory during the transaction; before it commits."""
        if self._last_seq_dirty and self._last_seq is not None:
            self.txn.put(keys.META_LAST_SEQ, keys.U64.pack(self._last_seq), False, True, False, self._meta)
            self._last_seq_dirty = False

    def clear_messages(self) -> None:
        # Dedup entries survive a purge, as SQS's do.
        for db in (self._messages, self._delivery, self._index, self._priority_index, self._dead, self._groups):
            self.txn.drop(db, delete=False)

    def record_event(self, event: Event) -> None:
        if isinstance(event, Sent):
            record = encode_record(event.record)
            delivery = encode_delivery(event.delivery)
            self._encoded_records[event.record.seq] = record
            self._encoded_deliveries[event.record.seq] = (event.delivery, delivery)
            self._events.append(encode_sent(event, record, delivery))
        elif isinstance(event, DeliveryChanged):
            delivery = encode_delivery(event.delivery)
            self._encoded_deliveries[event.delivery.seq] = (event.delivery, delivery)
            self._events.append(encode_delivery_changed(event, delivery))
        else:
            self._events.append(encode_event(event))

    def record_delivery_change(self, event: DeliveryChanged, *, previous: Delivery) -> None:
        # The delivery is encoded once, for the journal and the state, with no stop in
        # _encoded_deliveries between record_event and put_delivery.
        encoded = encode_delivery(event.delivery)
        self._events.append(encode_delivery_changed(event, encoded))
        self._write_delivery(event.delivery, encoded, previous)

    # -- the log ---------------------------------------------------------------
    def prune_log(self, *, before_ms: int, keep_after_index: int, limit: int) -> int:
        """Drop up to `limit` log entries older than before_ms, never above keep_after_index.

        Log pruning is this replica's bookkeeping, not a state change, so it
        writes no log entry of its own.
        """
        removed = 0
        cursor = self.txn.cursor(db=self._log)
        cursor.first()
        while (key := bytes(cursor.key())) and removed < limit:
            index = keys.U64.unpack(key)[0]
            _, _, at_ms, _ = decode_entry_head(cursor.value())
            if index > keep_after_index or at_ms >= before_ms:
                break
            cursor.delete()
            removed += 1
        return removed

    def write_log_entry(self, *, epoch: int, at_ms: int) -> int:
        self.flush_meta()
        if not self._events:
            return 0
        index = self.last_index() + 1
        entry = encode_entry(epoch=epoch, index=index, at_ms=at_ms, encoded_events=self._events)
        self.written_entry = entry
        self.txn.put(keys.U64.pack(index), entry, False, True, True, self._log)
        packed = keys.U64.pack(index)
        self.txn.put(keys.META_LAST_INDEX, packed, False, True, False, self._meta)
        # A leader applies as it decides, so its applied index is its last index.
        self.txn.put(keys.META_APPLIED_INDEX, packed, False, True, False, self._meta)
        self._events = []
        return index
