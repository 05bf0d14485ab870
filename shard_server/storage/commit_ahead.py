"""The commit-ahead file: a batch's log entry made durable in one write, before LMDB commits it.

LMDB makes a write transaction durable in two synchronous steps: its dirty pages, which
lie wherever its free list had room (one write request each), then its meta page through
an O_DSYNC descriptor; ~450-550 µs on this kind of disk for one send's transaction, most
of a lone send's answer (bench/LATENCY.md). A standalone shard instead writes the batch's
log entry here, in one O_DSYNC write into a file already written with zeros (~170 µs),
answers, and then commits to LMDB without the meta page's sync (LMDB's MDB_NOMETASYNC:
its pages are still synced, so the disk does two synchronous writes per batch, as before).

What that leaves undone, these records cover. With MDB_NOMETASYNC a commit's meta page
becomes durable with the next commit's sync, so after a crash LMDB may lack the last two
batches, never more (LMDB keeps the tree of the meta before the newest intact until a
transaction after it has synced). Two slots, used in turn by the entries' indexes, hold
them; opening the shard applies what LMDB lacks (`replica_log.recover_committed_ahead`),
as a follower applies replicated entries. A torn write fails its checksum and is
ignored: its batch was not answered. Each record names the copy of the data it belongs
to (the environment's incarnation), so records left beside a snapshot installed later
never apply to it.
"""

from __future__ import annotations

import os
import pathlib
import struct
import zlib
from typing import BinaryIO

from shard_server.storage.durable_files import replace_durably

FILE_NAME = "commit-ahead"
SLOTS = 2
SLOT_SIZE = 1 << 20
# Written whole with zeros when created, so a write never allocates blocks (an O_DSYNC
# write that extends or allocates also waits for the file system's journal).
CAPACITY = SLOTS * SLOT_SIZE
_MAGIC = b"shqahd01"
_INCARNATION_SIZE = 12
# magic, incarnation (hex), payload length, CRC-32 of incarnation and payload
_HEAD = struct.Struct(f">8s{_INCARNATION_SIZE}sII")
_ZEROS = bytes(SLOT_SIZE)


class CommitAheadFile:
    """The record file of one shard replica; used by its writer thread (and at open)."""

    def __init__(self, directory: pathlib.Path, *, create: bool = True) -> None:
        """Opens the file, creating it when `create` (else it must exist: FileNotFoundError)."""
        path = directory / FILE_NAME
        if create and (not path.exists() or path.stat().st_size != CAPACITY):
            _create_zeroed(path)
        # O_DSYNC: each write returns once it is on the disk, in one request.
        self._fd = os.open(path, os.O_RDWR | os.O_DSYNC | os.O_CLOEXEC)

    @staticmethod
    def fits(entry_size: int) -> bool:
        """Larger batches commit the usual way: their answers wait for LMDB's commit."""
        return _HEAD.size + entry_size <= SLOT_SIZE

    def write(self, entry: bytes, *, index: int, incarnation: str) -> None:
        """Make the entry of log index `index` durable; raises OSError if it could not be."""
        name = _incarnation_bytes(incarnation)
        head = _HEAD.pack(_MAGIC, name, len(entry), zlib.crc32(entry, zlib.crc32(name)))
        record = head + entry
        written = os.pwrite(self._fd, record, (index % SLOTS) * SLOT_SIZE)
        if written != len(record):
            raise OSError(f"commit-ahead record: wrote {written} of {len(record)} bytes")

    def read(self, *, incarnation: str) -> list[bytes]:
        """The entries of the whole records written for this copy of the data, any order."""
        return [entry for slot in range(SLOTS) if (entry := self._read_slot(slot, incarnation)) is not None]

    def _read_slot(self, slot: int, incarnation: str) -> bytes | None:
        start = slot * SLOT_SIZE
        head = os.pread(self._fd, _HEAD.size, start)
        if len(head) < _HEAD.size:
            return None
        magic, name, length, checksum = _HEAD.unpack(head)
        if magic != _MAGIC or name != _incarnation_bytes(incarnation) or not self.fits(length):
            return None
        entry = os.pread(self._fd, length, start + _HEAD.size)
        if len(entry) != length or zlib.crc32(entry, zlib.crc32(name)) != checksum:
            return None  # torn: the write did not finish, so its batch was never answered
        return entry

    def close(self) -> None:
        os.close(self._fd)


def _incarnation_bytes(incarnation: str) -> bytes:
    return incarnation.encode().ljust(_INCARNATION_SIZE, b"\0")[:_INCARNATION_SIZE]


def _create_zeroed(path: pathlib.Path) -> None:
    def zeroes(out: BinaryIO) -> None:
        for _ in range(SLOTS):
            out.write(_ZEROS)

    replace_durably(path, zeroes)
