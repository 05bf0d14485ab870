"""The cluster map: which servers exist, which queues, and where each shard's replicas live.

One model and one parser for every reader and writer: the local supervisor writes it
to `cluster.json`, the operator to a ConfigMap, and every shard server reads it (at
start, and again whenever it changes). Shard leases are named by `lease_name`, here
and nowhere else, so a server, a supervisor, an operator and a test all find the same Lease.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardq.coordination.placement import ServerState, ShardId, choose_initial_placement
from shardq.queues import QueueConfig, queue_config_from_spec

CLUSTER_FILE = "cluster.json"
# The key of the operator's ConfigMap that holds the map (the same text as the file).
CLUSTER_MAP_KEY = CLUSTER_FILE
DEFAULT_LEASE_DURATION_MS = 2_000

# A Kubernetes object name may be a DNS subdomain; a lease name is one label for the
# queue and one for the shard index, so it is always one.
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_NOT_IN_A_LABEL = re.compile(r"[^a-z0-9-]+")
_MAPPED_PREFIX = "q-"
_DIGEST_CHARACTERS = 10


@dataclasses.dataclass(frozen=True, slots=True)
class QueueEntry:
    """A queue as the user specified it: the spec is kept verbatim so servers parse the same text."""

    name: str
    spec: dict[str, Any]
    # Which creation of a queue of this name this is ("" where whoever wrote the map
    # does not say). A server holding data of another creation (a volume retained or
    # restored from before the queue was deleted and made again) discards it: that data
    # is not this queue's, and the namesake's new leases may start again at epoch 1.
    uid: str = ""

    @property
    def config(self) -> QueueConfig:
        return queue_config_from_spec(self.name, self.spec)


def new_queue_uid() -> str:
    """A uid for a queue created now (the operator uses the Queue object's own)."""
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True, slots=True)
class ServerEntry:
    server_id: str
    address: str
    # Where the server serves /metrics; "" when whoever wrote the map does not say.
    metrics_address: str = ""

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def metrics_port(self) -> int:
        return int(self.metrics_address.rpartition(":")[2])


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterMap:
    servers: dict[str, ServerEntry]
    queues: list[QueueEntry]
    # queue -> per shard, the replica server ids; the first is the shard's initial leader.
    placement: dict[str, list[list[str]]]
    lease_duration_ms: int = DEFAULT_LEASE_DURATION_MS

    def shards(self) -> list[ShardId]:
        return [
            ShardId(queue, index) for queue, shards in sorted(self.placement.items()) for index in range(len(shards))
        ]

    def replicas_of(self, shard: ShardId) -> tuple[str, ...]:
        return tuple(self.placement[shard.queue][shard.index])

    def queue_uid(self, name: str) -> str:
        """Which creation of queue `name` the map means ("" when it does not say)."""
        return next((queue.uid for queue in self.queues if queue.name == name), "")

    def address_of(self, server_id: str) -> str:
        """The server's gRPC address, or "" for a server the map does not know."""
        entry = self.servers.get(server_id)
        return entry.address if entry is not None else ""

    def queue_configs(self) -> list[QueueConfig]:
        return [queue.config for queue in self.queues]

    def shards_on(self, server_id: str, queue: str) -> list[int]:
        """The indexes of `queue`'s shards that have a replica on `server_id`."""
        return [index for index, replicas in enumerate(self.placement.get(queue, [])) if server_id in replicas]


def lease_name(shard: ShardId) -> str:
    """The lease of a shard, `orders.0`: always a valid Kubernetes object name.

    Queue names are DNS labels (the queue validator insists), so they map to themselves.
    Anything else (a name from before that rule, or from a hand-edited map) maps to a
    label made of its legal characters and a digest of the whole name: deterministic,
    so every reader finds the same Lease, and distinct for distinct names.
    """
    if shard.index < 0:
        raise ValueError(f"shard index must not be negative, got {shard.index}")
    return f"{lease_label(shard.queue)}.{shard.index}"


def lease_label(queue: str) -> str:
    """The queue part of its shards' lease names (see `lease_name`)."""
    if _DNS_LABEL.fullmatch(queue):
        return queue
    digest = hashlib.sha256(queue.encode()).hexdigest()[:_DIGEST_CHARACTERS]
    readable = _NOT_IN_A_LABEL.sub("-", queue.lower()).strip("-")
    room = 63 - len(_MAPPED_PREFIX) - 1 - _DIGEST_CHARACTERS
    readable = readable[:room].strip("-")
    return f"{_MAPPED_PREFIX}{readable}-{digest}" if readable else f"{_MAPPED_PREFIX}{digest}"


def place_queues(
    queues: Iterable[QueueEntry],
    server_ids: Sequence[str],
    *,
    placed: Mapping[str, Sequence[Sequence[str]]] | None = None,
) -> dict[str, list[list[str]]]:
    """Every queue's replicas placed across `server_ids` by the shared planner.

    Each queue goes where least is placed already, counting `placed` (the queues the map
    holds) and the queues placed before it in this call: a server's load for the planner
    is the number of shards it was placed to lead, and `hosted` the replicas it holds. So
    one-shard queues take turns leading on every server; with no counts every server tied,
    and the first by name led every queue's shard 0.
    """
    led = dict.fromkeys(server_ids, 0)
    hosted = dict.fromkeys(server_ids, 0)

    def count(shards: Iterable[Sequence[str]]) -> None:
        for replicas in shards:
            if replicas and replicas[0] in led:
                led[replicas[0]] += 1
            for server in replicas:
                if server in hosted:
                    hosted[server] += 1

    for shards in (placed or {}).values():
        count(shards)
    placement: dict[str, list[list[str]]] = {}
    for queue in queues:
        config = queue.config
        servers = [ServerState(name, load=float(led[name]), hosted=hosted[name]) for name in server_ids]
        try:
            chosen = choose_initial_placement(
                shards=[ShardId(queue.name, index) for index in range(config.shards)],
                replicas=config.replicas,
                servers=servers,
            )
        except ValueError as error:
            raise ValueError(f"queue {queue.name!r}: {error}") from None
        placement[queue.name] = [list(chosen[ShardId(queue.name, index)].replicas) for index in range(config.shards)]
        count(placement[queue.name])
    return placement


def cluster_map_to_json(cluster: ClusterMap) -> dict[str, Any]:
    return {
        "servers": {
            entry.server_id: {"address": entry.address, "metrics_address": entry.metrics_address}
            for entry in cluster.servers.values()
        },
        "queues": [
            {"name": queue.name, "spec": queue.spec, **({"uid": queue.uid} if queue.uid else {})}
            for queue in cluster.queues
        ],
        "placement": cluster.placement,
        "lease_duration_ms": cluster.lease_duration_ms,
    }


def cluster_map_from_json(data: Mapping[str, Any]) -> ClusterMap:
    """Parse and check a cluster map; raises ValueError naming what is wrong."""
    try:
        servers = {
            str(server_id): ServerEntry(
                server_id=str(server_id),
                address=str(entry["address"]),
                metrics_address=str(entry.get("metrics_address", "")),
            )
            for server_id, entry in data["servers"].items()
        }
        queues = [
            QueueEntry(name=str(queue["name"]), spec=dict(queue.get("spec", {})), uid=str(queue.get("uid", "")))
            for queue in data["queues"]
        ]
        placement = {
            str(queue): [[str(server) for server in replicas] for replicas in shards]
            for queue, shards in data["placement"].items()
        }
        lease_duration_ms = int(data.get("lease_duration_ms", DEFAULT_LEASE_DURATION_MS))
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a valid cluster map: {error!r}") from None
    if lease_duration_ms <= 0:
        raise ValueError(f"lease_duration_ms must be positive, got {lease_duration_ms}")
    names = [queue.name for queue in queues]
    if len(set(names)) != len(names):
        raise ValueError(f"queue names must be unique: {names}")
    for queue in queues:
        config = queue.config
        shards = placement.get(queue.name)
        if shards is None or len(shards) != config.shards:
            raise ValueError(f"queue {queue.name!r} needs a placement for each of its {config.shards} shards")
        for index, replicas in enumerate(shards):
            if not replicas or len(set(replicas)) != len(replicas) or not set(replicas) <= servers.keys():
                raise ValueError(f"{queue.name} shard {index}: replicas {replicas} must be distinct known servers")
    return ClusterMap(servers=servers, queues=queues, placement=placement, lease_duration_ms=lease_duration_ms)


def cluster_map_from_text(text: str) -> ClusterMap:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError("not a valid cluster map: the top level must be an object")
    return cluster_map_from_json(data)


def cluster_map_to_text(cluster: ClusterMap) -> str:
    return json.dumps(cluster_map_to_json(cluster), indent=2, sort_keys=True) + "\n"


def read_cluster_map(path: pathlib.Path) -> ClusterMap:
    """The map in `path` (a cluster.json, or a file a ConfigMap is mounted as)."""
    try:
        return cluster_map_from_text(path.read_text())
    except OSError as error:
        raise ValueError(f"{path}: cannot read the cluster map: {error.strerror}") from None
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def write_cluster_map(path: pathlib.Path, cluster: ClusterMap) -> pathlib.Path:
    """Write atomically: a server that reads the map while it changes sees the old or the new one."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(cluster_map_to_text(cluster))
    os.replace(scratch, path)
    return path


# Settings fixed when a queue is created: changing them would move messages between
# shards, change the queue's ordering promise, or its replica placement.
IMMUTABLE_SETTINGS = ("shards", "fifo", "replicas")


def with_queue_added(cluster: ClusterMap, queue: QueueEntry, *, on: Sequence[str] | None = None) -> ClusterMap:
    """The map with `queue` placed by the shared planner on servers `on` (default: every
    server of the map; the operator leaves out servers being drained).

    Raises ValueError if a queue of that name exists or the queue cannot be placed.
    """
    if any(existing.name == queue.name for existing in cluster.queues):
        raise ValueError(f"queue {queue.name!r} exists already")
    servers = list(cluster.servers) if on is None else list(on)
    placement = {**cluster.placement, **place_queues([queue], servers, placed=cluster.placement)}
    return dataclasses.replace(cluster, queues=[*cluster.queues, queue], placement=placement)


def with_queue_removed(cluster: ClusterMap, name: str) -> ClusterMap:
    """The map without queue `name`; a queue that names it as dead-letter queue keeps it."""
    users = sorted(queue.name for queue in cluster.queues if queue.config.dead_letter_queue == name)
    if users:
        raise ValueError(f"queue {name!r} is the dead-letter queue of {', '.join(users)}: change those first")
    if all(queue.name != name for queue in cluster.queues):
        raise ValueError(f"queue {name!r} is not in the cluster map")
    placement = {queue: shards for queue, shards in cluster.placement.items() if queue != name}
    return dataclasses.replace(
        cluster, queues=[queue for queue in cluster.queues if queue.name != name], placement=placement
    )


def with_queue_changed(cluster: ClusterMap, queue: QueueEntry) -> ClusterMap:
    """The map with `queue`'s settings replaced; settings fixed at creation may not change.
    A `queue` that does not name its uid keeps the one the map has."""
    current = next((entry for entry in cluster.queues if entry.name == queue.name), None)
    if current is None:
        raise ValueError(f"queue {queue.name!r} is not in the cluster map")
    if not queue.uid:
        queue = dataclasses.replace(queue, uid=current.uid)
    before, after = current.config, queue.config
    fixed = [setting for setting in IMMUTABLE_SETTINGS if getattr(before, setting) != getattr(after, setting)]
    if fixed:
        raise ValueError(f"{', '.join(fixed)} cannot change after a queue is created (create another queue)")
    return dataclasses.replace(
        cluster, queues=[queue if entry.name == queue.name else entry for entry in cluster.queues]
    )


@dataclasses.dataclass(frozen=True, slots=True)
class MapChange:
    """What a server must do when the map it runs with is replaced by another."""

    added: list[QueueEntry]
    removed: list[str]
    # Same queue, other settings (only those that may change: see IMMUTABLE_SETTINGS).
    changed: list[QueueEntry]
    # Queues whose shards, ordering or replication factor changed: a running server
    # cannot apply that, so it keeps the old and says so.
    refused: dict[str, str]
    # Queues with replicas added or removed (`replica_moves`): servers open new
    # replicas, drop the ones that left, and leaders ship to the new set.
    moved: list[str] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.refused or self.moved)


def recreated(was: QueueEntry, now: QueueEntry) -> bool:
    """Whether `now` is another creation of the queue `was` (both name their uid): the
    one deleted and the other made under its name since."""
    return bool(was.uid and now.uid and was.uid != now.uid)


def new_shards(old: ClusterMap | None, new: ClusterMap) -> list[ShardId]:
    """The shards of `new` that need a new shard's lease (`lease_for_new_shard`): those
    `old` did not have, and those of a queue made again under its name since."""
    if old is None:
        return new.shards()
    added = {queue.name for queue in change_between(old, new).added}
    known = set(old.shards())
    return [shard for shard in new.shards() if shard not in known or shard.queue in added]


def change_between(old: ClusterMap, new: ClusterMap) -> MapChange:
    """How `new` differs from `old`, queue by queue. A queue deleted and made again under
    its name (another uid) is removed and added: the old one's data goes."""
    before = {queue.name: queue for queue in old.queues}
    after = {queue.name: queue for queue in new.queues}
    renewed = {name for name in before.keys() & after.keys() if recreated(before[name], after[name])}
    changed: list[QueueEntry] = []
    refused: dict[str, str] = {}
    moved: list[str] = []
    for name in sorted((before.keys() & after.keys()) - renewed):
        was_placed, now_placed = old.placement.get(name, []), new.placement.get(name, [])
        if before[name].spec == after[name].spec and was_placed == now_placed:
            continue
        was, now = before[name].config, after[name].config
        fixed = [setting for setting in IMMUTABLE_SETTINGS if getattr(was, setting) != getattr(now, setting)]
        if fixed:
            refused[name] = f"{', '.join(fixed)} cannot change on a running queue"
            continue
        if len(was_placed) != len(now_placed):
            refused[name] = f"its placement lists {len(now_placed)} shards where it had {len(was_placed)}"
            continue
        if before[name].spec != after[name].spec:
            changed.append(after[name])
        if was_placed != now_placed:
            moved.append(name)
    return MapChange(
        added=[after[name] for name in sorted((after.keys() - before.keys()) | renewed)],
        removed=sorted((before.keys() - after.keys()) | renewed),
        changed=changed,
        refused=refused,
        moved=moved,
    )
