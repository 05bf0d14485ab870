"""The local lease store: every lease of a `shardq local` cluster in one shared directory,
written without a lock.

Why no lock: the store used to be one LMDB file, whose single writer lock made "read the
version, compare, write" atomic. A server SIGSTOPped while holding that lock (a paused
process, a debugger, a Ctrl-Z) froze every renewal and every failover of the cluster
until it went on: the supervisor could not take over the paused leader's shards, the one
fault leases exist for. A fault test in CI found it (`shardq local`'s supervisor stayed
silent for 30 s after a leader was paused). Here no writer ever holds anything another
writer waits for, so a process may stop at any instruction.

How compare-and-swap works without one:

- Each lease is a directory named after it; each version of the lease is a file in it,
  named by its number and holding the whole record and a random nonce. A record's
  `version` is "<number>.<nonce>".
- A writer going from version n checks that n is the version it read (the same nonce),
  writes the new record under a temporary name, fsyncs it, and hard-links it to the name
  n + 1. link(2) fails when the name exists, so of the writers going from n exactly one
  makes n + 1; the rest get LeaseConflict.
- A reader takes the highest number. A file is linked only once it is complete, so a
  reader never sees part of a record.
- Old versions are removed, lowest first, keeping the last `KEEP_VERSIONS`. A writer
  stopped for long enough could then find n + 1 free again and link it. So after linking,
  a writer checks that version n is still the file it read (the same nonce): version n
  is removed before n + 1 is, so while it is there n + 1 was never taken before. If n is
  gone, the writer reports a conflict. What it linked sits below the highest number,
  where no reader looks, until the next clean-up removes it.
- A writer stopped between its link and that check can come back to find n removed by
  others' writes and report a conflict for a write that took. A caller of the Kubernetes
  store whose connection drops after its write is told of a failure in the same way, and
  a lease holder reads the lease again after a conflict.

Every write is on disk (the file and the directory entry fsynced) before the caller hears
of it. A temporary file left by a process killed mid-write is removed by a later clean-up.

Clusters made before this store kept their leases in one LMDB file, `leases.lmdb`;
`import_lmdb_leases` copies them over, epochs and all, so an upgraded cluster's fencing
tokens do not go back to 1.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import pathlib
import secrets
import time
from typing import Any

import lmdb

from shardq.coordination.leases import LeaseConflict, LeaseRecord

# Versions kept per lease; more than any writer can be behind by between its read and its
# link in normal running, so a clean-up rarely turns a writer's success into a conflict.
KEEP_VERSIONS = 16
# A temporary file this old was left by a process that died mid-write.
STALE_TEMPORARY_S = 60.0
_FORMAT = 1
_MAX_NAME_BYTES = 253
_VERSION_DIGITS = 20
_TEMPORARY_PREFIX = ".tmp."


class LocalLeaseStore:
    """A LeaseStore over one directory, safe to share between threads and processes."""

    def __init__(self, path: pathlib.Path) -> None:
        if path.exists() and not path.is_dir():
            raise ValueError(
                f"{path} is not a lease directory (a lease file of an older shardq? "
                "`shardq local up` imports one named leases.lmdb from its data directory)"
            )
        path.mkdir(parents=True, exist_ok=True)
        self.path = path

    def close(self) -> None:
        """Nothing to release: the store holds no open files between calls."""

    def __enter__(self) -> LocalLeaseStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(self, name: str) -> LeaseRecord | None:
        directory = self.path / _checked_name(name)
        while True:
            versions = _versions(directory)
            if not versions:
                return None
            try:
                stored = (directory / _version_file(versions[-1])).read_bytes()
            except FileNotFoundError:
                continue  # cleaned up after this reader listed it: a newer one is there now
            return _decode(name, stored)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        directory = self.path / _checked_name(record.name)
        if not directory.exists():
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
            _fsync_directory(self.path)
        created = self._link(directory, record, 1)
        if created is None:
            raise LeaseConflict(f"lease {record.name!r} already exists")
        return created

    def update(self, record: LeaseRecord) -> LeaseRecord:
        if not record.version:
            raise ValueError(f"lease {record.name!r}: an update needs the version it was read at")
        directory = self.path / _checked_name(record.name)
        number, nonce = _parse_version(record.name, record.version)
        # Before linking too: a version this lease never had (read before its directory
        # was made again) would otherwise link above the highest and be read as current.
        if _nonce_of(directory, number) != nonce:
            if not _versions(directory):
                raise LeaseConflict(f"lease {record.name!r} does not exist")
            raise LeaseConflict(f"lease {record.name!r} has no version {record.version}")
        updated = self._link(directory, record, number + 1)
        if updated is None:
            raise LeaseConflict(f"lease {record.name!r} changed since version {record.version}")
        if _nonce_of(directory, number) != nonce:
            # Version `number` was removed, so `number + 1` had been taken and removed too:
            # this writer read the lease long ago (see the module docstring).
            raise LeaseConflict(f"lease {record.name!r} moved on long past version {record.version}")
        if (number + 1) % KEEP_VERSIONS == 0:
            _clean_up(directory, keep_from=number + 2 - KEEP_VERSIONS)
        return updated

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        # Sorted by UTF-8 bytes, the order the Kubernetes store and the old LMDB file gave.
        names = sorted(
            (entry.name for entry in os.scandir(self.path) if entry.name.startswith(prefix) and entry.is_dir()),
            key=str.encode,
        )
        found: builtins.list[LeaseRecord] = []
        for name in names:
            record = self.get(name)
            if record is not None:
                found.append(record)
        return found

    def _link(self, directory: pathlib.Path, record: LeaseRecord, number: int) -> LeaseRecord | None:
        """Store `record` as version `number` of its lease; None if that version exists."""
        nonce = secrets.token_hex(8)
        stored = _with_version(record, f"{number}.{nonce}")
        temporary = directory / f"{_TEMPORARY_PREFIX}{nonce}"
        with temporary.open("xb") as file:
            file.write(_encode(stored, number=number, nonce=nonce))
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, directory / _version_file(number))
        except FileExistsError:
            return None
        finally:
            os.unlink(temporary)
        _fsync_directory(directory)
        return stored


def import_lmdb_leases(lmdb_file: pathlib.Path, store: LocalLeaseStore) -> int:
    """Copy every lease from an older cluster's LMDB lease file into `store`; holders,
    epochs and annotations carry over. A lease `store` already holds is kept, so an import
    cut short can run again. How many were copied."""
    copied = 0
    try:
        environment = lmdb.open(str(lmdb_file), subdir=False, readonly=True, lock=False, max_dbs=0)
    except lmdb.Error as error:
        raise ValueError(f"cannot read the older lease file {lmdb_file}: {error}") from None
    try:
        with environment.begin() as txn:
            for key, value in txn.cursor():
                name = bytes(key).decode()
                fields = json.loads(bytes(value))
                if fields.get("format") != _FORMAT:
                    raise ValueError(f"lease {name!r} in {lmdb_file} is in unknown format {fields.get('format')!r}")
                try:
                    store.create(_record_from_fields(name, fields, version=""))
                except LeaseConflict:
                    continue
                copied += 1
    finally:
        environment.close()
    return copied


def _checked_name(name: str) -> str:
    # The same bounds as a Kubernetes object name, so a name that works here works there;
    # and a name must be one directory entry of its own.
    if not 0 < len(name.encode()) <= _MAX_NAME_BYTES:
        raise ValueError(f"lease names are 1 to {_MAX_NAME_BYTES} bytes, got {name!r}")
    if "/" in name or "\0" in name or name.startswith("."):
        raise ValueError(f"lease names cannot hold '/' or NUL or start with '.', got {name!r}")
    return name


def _version_file(number: int) -> str:
    return f"{number:0{_VERSION_DIGITS}d}"


def _versions(directory: pathlib.Path) -> list[int]:
    """The lease's version numbers, lowest first ([] if it was never created)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(name) for name in names if name.isdigit())


def _parse_version(name: str, version: str) -> tuple[int, str]:
    number, dot, nonce = version.partition(".")
    if not (dot and number.isdigit() and nonce):
        raise LeaseConflict(f"lease {name!r}: {version!r} is not a version this store gave out")
    return int(number), nonce


def _nonce_of(directory: pathlib.Path, number: int) -> str | None:
    try:
        stored = (directory / _version_file(number)).read_bytes()
    except FileNotFoundError:
        return None
    return str(json.loads(stored)["nonce"])


def _clean_up(directory: pathlib.Path, *, keep_from: int) -> None:
    """Remove versions below `keep_from`, lowest first (the order `update`'s check relies
    on), and temporary files a killed writer left."""
    for number in _versions(directory):
        if number >= keep_from:
            break
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / _version_file(number))
    now = time.time()
    for entry in os.scandir(directory):
        if entry.name.startswith(_TEMPORARY_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > STALE_TEMPORARY_S:
                    os.unlink(entry.path)


def _fsync_directory(directory: pathlib.Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _with_version(record: LeaseRecord, version: str) -> LeaseRecord:
    return LeaseRecord(
        name=record.name,
        holder=record.holder,
        acquire_time_ms=record.acquire_time_ms,
        renew_time_ms=record.renew_time_ms,
        duration_ms=record.duration_ms,
        transitions=record.transitions,
        annotations=dict(record.annotations),
        version=version,
    )


def _encode(record: LeaseRecord, *, number: int, nonce: str) -> bytes:
    fields: dict[str, Any] = {
        "format": _FORMAT,
        "holder": record.holder,
        "acquire_time_ms": record.acquire_time_ms,
        "renew_time_ms": record.renew_time_ms,
        "duration_ms": record.duration_ms,
        "transitions": record.transitions,
        "annotations": record.annotations,
        "version": number,
        "nonce": nonce,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _decode(name: str, stored: bytes) -> LeaseRecord:
    fields = json.loads(stored)
    if fields.get("format") != _FORMAT:
        raise ValueError(f"lease {name!r} is stored in unknown format {fields.get('format')!r}")
    return _record_from_fields(name, fields, version=f"{fields['version']}.{fields['nonce']}")


def _record_from_fields(name: str, fields: dict[str, Any], *, version: str) -> LeaseRecord:
    return LeaseRecord(
        name=name,
        holder=str(fields["holder"]),
        acquire_time_ms=int(fields["acquire_time_ms"]),
        renew_time_ms=int(fields["renew_time_ms"]),
        duration_ms=int(fields["duration_ms"]),
        transitions=int(fields["transitions"]),
        annotations={str(key): str(value) for key, value in fields["annotations"].items()},
        version=version,
    )
