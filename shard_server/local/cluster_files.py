"""The files a local cluster keeps in its data directory: the cluster map, the supervisor
record and the lease store.

`cluster.json` is the cluster map (`shardq.coordination.cluster_map`, the one model every
server reads); a local cluster's servers listen on consecutive loopback ports. The map is
written once and reused, so a restarted cluster keeps its placement and therefore its data. `supervisor.json` tells
`shardq local status` which processes the running supervisor started. `peer-secret` is what
the servers present to each other (shardq.coordination.peer_credentials), readable by the
owner only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from shardq.coordination.cluster_map import (
    CLUSTER_FILE,
    ClusterMap,
    QueueEntry,
    ServerEntry,
    new_queue_uid,
    place_queues,
    read_cluster_map,
    write_cluster_map,
)
from shardq.coordination.local_leases import LocalLeaseStore, import_lmdb_leases
from shardq.coordination.peer_credentials import (
    NO_PEER_SECRET,
    PeerCredential,
    new_peer_secret,
    read_peer_secret,
    write_peer_secret,
)

SUPERVISOR_FILE = "supervisor.json"
PEER_SECRET_FILE = "peer-secret"
LEASE_STORE_DIR = "leases"
# Where clusters made before the lock-free lease store kept their leases: imported once
# (open_cluster_lease_store), then renamed with IMPORTED_SUFFIX.
LMDB_LEASE_FILE = "leases.lmdb"
IMPORTED_SUFFIX = ".imported"
LOOPBACK = "127.0.0.1"
# Metrics ports sit this far above gRPC ports (7601 → 9601), so both ranges are easy to read.
METRICS_PORT_OFFSET = 2000


def parse_queue_argument(text: str) -> QueueEntry:
    """`name[:key=value,...]` as given to `--queue`; validated by the same parser the servers use."""
    name, _, rest = text.partition(":")
    spec: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--queue {text!r}: {item!r} is not key=value")
        spec[key.strip()] = value.strip()
    entry = QueueEntry(name=name.strip(), spec=spec, uid=new_queue_uid())
    entry.config  # noqa: B018 -- parsing is the validation; an invalid spec raises ValueError here
    return entry


def build_cluster_file(
    *, queues: Sequence[QueueEntry], server_count: int, base_port: int, metrics_base_port: int, lease_duration_ms: int
) -> ClusterMap:
    """Servers s1..sN on consecutive loopback ports, and every queue's replicas placed across them."""
    if server_count < 1:
        raise ValueError(f"a cluster needs at least one server, got {server_count}")
    if lease_duration_ms <= 0:
        raise ValueError(f"the lease duration must be positive, got {lease_duration_ms} ms")
    names = [queue.name for queue in queues]
    if len(set(names)) != len(names):
        raise ValueError(f"queue names must be unique: {names}")
    servers = {
        f"s{number}": ServerEntry(
            server_id=f"s{number}",
            address=f"{LOOPBACK}:{base_port + number - 1}",
            metrics_address=f"{LOOPBACK}:{metrics_base_port + number - 1}",
        )
        for number in range(1, server_count + 1)
    }
    placement = place_queues(queues, list(servers))
    return ClusterMap(servers=servers, queues=list(queues), placement=placement, lease_duration_ms=lease_duration_ms)


def read_cluster_file(data_dir: pathlib.Path) -> ClusterMap:
    return read_cluster_map(data_dir / CLUSTER_FILE)


def write_cluster_file(data_dir: pathlib.Path, cluster: ClusterMap) -> pathlib.Path:
    return write_cluster_map(data_dir / CLUSTER_FILE, cluster)


def ensure_peer_secret(data_dir: pathlib.Path) -> PeerCredential:
    """The cluster's peer secret, made when the cluster first starts (a cluster made before
    there were secrets gets one then: its servers all start anew with it)."""
    path = data_dir / PEER_SECRET_FILE
    if not path.exists():
        write_peer_secret(path, new_peer_secret())
    return read_peer_secret(path)


def read_cluster_peer_secret(data_dir: pathlib.Path) -> PeerCredential:
    """The cluster's peer secret, for the calls `status` makes; none before its first start."""
    path = data_dir / PEER_SECRET_FILE
    return read_peer_secret(path) if path.exists() else NO_PEER_SECRET


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisedServer:
    server_id: str
    pid: int
    endpoint: str
    metrics_endpoint: str
    log: str


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorRecord:
    """What a running supervisor started: read by `status`, removed when the supervisor exits."""

    pid: int
    servers: dict[str, SupervisedServer]


def supervisor_record_to_json(record: SupervisorRecord) -> dict[str, Any]:
    return {"pid": record.pid, "servers": {name: dataclasses.asdict(entry) for name, entry in record.servers.items()}}


def read_supervisor_record(data_dir: pathlib.Path) -> SupervisorRecord | None:
    """The record of the supervisor that runs (or ran and was killed) here, or None."""
    path = data_dir / SUPERVISOR_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    servers = {str(name): SupervisedServer(**entry) for name, entry in data["servers"].items()}
    return SupervisorRecord(pid=int(data["pid"]), servers=servers)


def write_supervisor_record(data_dir: pathlib.Path, record: SupervisorRecord) -> pathlib.Path:
    return write_json_atomically(data_dir / SUPERVISOR_FILE, supervisor_record_to_json(record))


def remove_supervisor_record(data_dir: pathlib.Path) -> None:
    (data_dir / SUPERVISOR_FILE).unlink(missing_ok=True)


def write_json_atomically(path: pathlib.Path, data: Mapping[str, Any]) -> pathlib.Path:
    # A reader (a starting server, `status`) must never see half a file: write aside, then rename.
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(scratch, path)
    return path


def open_cluster_lease_store(data_dir: pathlib.Path) -> tuple[LocalLeaseStore, int]:
    """The cluster's lease store, and how many leases it imported from the LMDB lease file
    of an older shardq (0 when there is none). Imported before any server starts, a shard
    keeps its epoch: new leases at epoch 1 would hand out fencing tokens the servers'
    data has already seen."""
    store = LocalLeaseStore(data_dir / LEASE_STORE_DIR)
    old_file = data_dir / LMDB_LEASE_FILE
    if not old_file.is_file():
        return store, 0
    imported = import_lmdb_leases(old_file, store)
    old_file.rename(old_file.with_name(old_file.name + IMPORTED_SUFFIX))
    pathlib.Path(f"{old_file}-lock").unlink(missing_ok=True)
    return store, imported
