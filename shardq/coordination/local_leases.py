"""The local lease store: every lease of a `shardq local` cluster in one shared LMDB file.

LMDB admits one write transaction at a time across all processes that open the file
(lock=True), so "read the version, compare, write" inside one write transaction is an
atomic compare-and-swap. A lease's version is a counter kept with it and incremented on
every write; leases are never deleted, so a version is never reused for the same name.
"""

from __future__ import annotations

import builtins
import json
import pathlib
from typing import Any

import lmdb

from shardq.coordination.leases import LeaseConflict, LeaseRecord

# Leases are a few hundred bytes each; the map is sparse, so this costs no disk.
DEFAULT_MAP_SIZE = 64 << 20
_FORMAT = 1
_MAX_NAME_BYTES = 253


class LocalLeaseStore:
    """A LeaseStore over one LMDB file, safe to share between threads and processes.

    Open one per process, after any fork: LMDB environments must not cross a fork.
    """

    def __init__(self, path: pathlib.Path, *, map_size: int = DEFAULT_MAP_SIZE) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._env = lmdb.open(
            str(path),
            subdir=False,
            map_size=map_size,
            max_dbs=0,
            lock=True,
            # Commits do not flush; every write flushes right after its commit
            # instead (`_flush`), outside LMDB's writer lock. Every process of the
            # cluster shares that lock, and a process SIGSTOPped while holding it
            # would freeze every renewal and failover: the lock must be held for
            # microseconds, not for an fsync. A handed-out epoch is still on disk
            # before the caller hears of it. The price: a machine crash in the
            # instant between a commit and its flush can damage this file (a
            # process crash cannot), which a local development cluster can afford.
            sync=False,
            metasync=False,
        )
        # A SIGKILLed process leaves its reader slot behind; a stale slot pins old pages
        # and makes the file grow. Local clusters kill processes on purpose, so sweep.
        self._env.reader_check()

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> LocalLeaseStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(self, name: str) -> LeaseRecord | None:
        with self._env.begin() as txn:
            stored = txn.get(_key(name))
        return None if stored is None else _decode(name, stored)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        created = _with_version(record, 1)
        with self._env.begin(write=True) as txn:
            # put(overwrite=False) checks and writes under the one write lock.
            if not txn.put(_key(record.name), _encode(created), overwrite=False):
                raise LeaseConflict(f"lease {record.name!r} already exists")
        self._flush()
        return created

    def update(self, record: LeaseRecord) -> LeaseRecord:
        if not record.version:
            raise ValueError(f"lease {record.name!r}: an update needs the version it was read at")
        key = _key(record.name)
        with self._env.begin(write=True) as txn:
            stored = txn.get(key)
            if stored is None:
                raise LeaseConflict(f"lease {record.name!r} does not exist")
            current = _decode(record.name, stored)
            if current.version != record.version:
                raise LeaseConflict(f"lease {record.name!r} is at version {current.version}, not {record.version}")
            updated = _with_version(record, int(current.version) + 1)
            txn.put(key, _encode(updated))
        self._flush()
        return updated

    def _flush(self) -> None:
        """Make every committed write durable (see the sync=False note in __init__)."""
        self._env.sync(True)

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        start = prefix.encode()
        found: builtins.list[LeaseRecord] = []
        with self._env.begin() as txn, txn.cursor() as cursor:
            # Keys are UTF-8 names, so byte order is name order and a prefix is a range.
            if not cursor.set_range(start):
                return found
            for key, value in cursor:
                if not key.startswith(start):
                    break
                found.append(_decode(key.decode(), value))
        return found


def _key(name: str) -> bytes:
    key = name.encode()
    # The same bounds as a Kubernetes object name, so a name that works here works there.
    if not 0 < len(key) <= _MAX_NAME_BYTES:
        raise ValueError(f"lease names are 1 to {_MAX_NAME_BYTES} bytes, got {name!r}")
    return key


def _with_version(record: LeaseRecord, version: int) -> LeaseRecord:
    return LeaseRecord(
        name=record.name,
        holder=record.holder,
        acquire_time_ms=record.acquire_time_ms,
        renew_time_ms=record.renew_time_ms,
        duration_ms=record.duration_ms,
        transitions=record.transitions,
        annotations=dict(record.annotations),
        version=str(version),
    )


def _encode(record: LeaseRecord) -> bytes:
    fields: dict[str, Any] = {
        "format": _FORMAT,
        "holder": record.holder,
        "acquire_time_ms": record.acquire_time_ms,
        "renew_time_ms": record.renew_time_ms,
        "duration_ms": record.duration_ms,
        "transitions": record.transitions,
        "annotations": record.annotations,
        "version": int(record.version),
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _decode(name: str, stored: bytes) -> LeaseRecord:
    fields = json.loads(stored)
    if fields.get("format") != _FORMAT:
        raise ValueError(f"lease {name!r} is stored in unknown format {fields.get('format')!r}")
    return LeaseRecord(
        name=name,
        holder=str(fields["holder"]),
        acquire_time_ms=int(fields["acquire_time_ms"]),
        renew_time_ms=int(fields["renew_time_ms"]),
        duration_ms=int(fields["duration_ms"]),
        transitions=int(fields["transitions"]),
        annotations={str(key): str(value) for key, value in fields["annotations"].items()},
        version=str(fields["version"]),
    )
