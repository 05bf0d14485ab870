"""The files a local cluster keeps in its data directory: the cluster file and the supervisor record.

`cluster.json` is the contract with the servers (which servers exist, which queues, where
each shard's replicas live, how long a lease lasts); it is written once and reused, so a
restarted cluster keeps its placement and therefore its data. `supervisor.json` tells
`shardq local status` which processes the running supervisor started.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from shardq.planning import ServerState, ShardId, choose_initial_placement
from shardq.queues import QueueConfig, queue_config_from_spec

CLUSTER_FILE = "cluster.json"
SUPERVISOR_FILE = "supervisor.json"
LEASE_STORE_FILE = "leases.lmdb"
LOOPBACK = "127.0.0.1"
# Metrics ports sit this far above gRPC ports (7601 → 9601), so both ranges are easy to read.
METRICS_PORT_OFFSET = 2000


@dataclasses.dataclass(frozen=True, slots=True)
class QueueEntry:
    """A queue as the user specified it: the spec is kept verbatim so servers parse the same text."""

    name: str
    spec: dict[str, Any]

    @property
    def config(self) -> QueueConfig:
        return queue_config_from_spec(self.name, self.spec)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerEntry:
    server_id: str
    address: str
    metrics_address: str

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def metrics_port(self) -> int:
        return int(self.metrics_address.rpartition(":")[2])


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterFile:
    servers: dict[str, ServerEntry]
    queues: list[QueueEntry]
    # queue -> per shard, the replica server ids; the first is the shard's initial leader.
    placement: dict[str, list[list[str]]]
    lease_duration_ms: int

    def shards(self) -> list[ShardId]:
        return [
            ShardId(queue, index) for queue, shards in sorted(self.placement.items()) for index in range(len(shards))
        ]

    def replicas_of(self, shard: ShardId) -> tuple[str, ...]:
        return tuple(self.placement[shard.queue][shard.index])


def lease_name(shard: ShardId) -> str:
    """The lease of a shard, as servers look it up: `orders.0`."""
    return f"{shard.queue}.{shard.index}"


def parse_queue_argument(text: str) -> QueueEntry:
    """`name[:key=value,...]` as given to `--queue`; validated by the same parser the servers use."""
    name, _, rest = text.partition(":")
    spec: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--queue {text!r}: {item!r} is not key=value")
        spec[key.strip()] = value.strip()
    entry = QueueEntry(name=name.strip(), spec=spec)
    entry.config  # noqa: B018 -- parsing is the validation; an invalid spec raises ValueError here
    return entry


def build_cluster_file(
    *, queues: Sequence[QueueEntry], server_count: int, base_port: int, metrics_base_port: int, lease_duration_ms: int
) -> ClusterFile:
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
    placement: dict[str, list[list[str]]] = {}
    for queue in queues:
        config = queue.config
        try:
            chosen = choose_initial_placement(
                shards=[ShardId(queue.name, index) for index in range(config.shards)],
                replicas=config.replicas,
                servers=[ServerState(name) for name in servers],
            )
        except ValueError as error:
            raise ValueError(f"queue {queue.name!r}: {error}") from None
        placement[queue.name] = [list(chosen[ShardId(queue.name, index)].replicas) for index in range(config.shards)]
    return ClusterFile(servers=servers, queues=list(queues), placement=placement, lease_duration_ms=lease_duration_ms)


def cluster_file_to_json(cluster: ClusterFile) -> dict[str, Any]:
    return {
        "servers": {
            entry.server_id: {"address": entry.address, "metrics_address": entry.metrics_address}
            for entry in cluster.servers.values()
        },
        "queues": [{"name": queue.name, "spec": queue.spec} for queue in cluster.queues],
        "placement": cluster.placement,
        "lease_duration_ms": cluster.lease_duration_ms,
    }


def cluster_file_from_json(data: Mapping[str, Any]) -> ClusterFile:
    """Parse and check a cluster file; raises ValueError naming what is wrong."""
    try:
        servers = {
            str(server_id): ServerEntry(
                server_id=str(server_id), address=str(entry["address"]), metrics_address=str(entry["metrics_address"])
            )
            for server_id, entry in data["servers"].items()
        }
        queues = [QueueEntry(name=str(queue["name"]), spec=dict(queue.get("spec", {}))) for queue in data["queues"]]
        placement = {
            str(queue): [[str(server) for server in replicas] for replicas in shards]
            for queue, shards in data["placement"].items()
        }
        lease_duration_ms = int(data["lease_duration_ms"])
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a valid cluster file: {error!r}") from None
    for queue in queues:
        config = queue.config
        shards = placement.get(queue.name)
        if shards is None or len(shards) != config.shards:
            raise ValueError(f"queue {queue.name!r} needs a placement for each of its {config.shards} shards")
        for index, replicas in enumerate(shards):
            if not replicas or len(set(replicas)) != len(replicas) or not set(replicas) <= servers.keys():
                raise ValueError(f"{queue.name} shard {index}: replicas {replicas} must be distinct known servers")
    return ClusterFile(servers=servers, queues=queues, placement=placement, lease_duration_ms=lease_duration_ms)


def read_cluster_file(data_dir: pathlib.Path) -> ClusterFile:
    path = data_dir / CLUSTER_FILE
    try:
        return cluster_file_from_json(json.loads(path.read_text()))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def write_cluster_file(data_dir: pathlib.Path, cluster: ClusterFile) -> pathlib.Path:
    return write_json_atomically(data_dir / CLUSTER_FILE, cluster_file_to_json(cluster))


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
