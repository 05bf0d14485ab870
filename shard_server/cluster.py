"""The cluster file: which servers exist, which queues, and where each shard's replicas live.

Written by whoever places replicas (the local supervisor now, the operator later)
and read by every server at start. Shard leases in the lease store are named
`<queue>.<shard>` and held by server ids from this file.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from shardq.queues import QueueConfig, queue_config_from_spec

DEFAULT_LEASE_DURATION_MS = 2_000


@dataclasses.dataclass(frozen=True)
class ClusterFile:
    servers: dict[str, str]  # server id -> gRPC address
    queues: list[QueueConfig]
    # queue -> per shard, the replica server ids (the first is the initial leader)
    placement: dict[str, list[list[str]]]
    lease_duration_ms: int = DEFAULT_LEASE_DURATION_MS

    def replicas_of(self, queue: str, shard: int) -> list[str]:
        return self.placement[queue][shard]


def lease_name(queue: str, shard: int) -> str:
    return f"{queue}.{shard}"


def load_cluster_file(path: pathlib.Path) -> ClusterFile:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        servers = {str(name): str(entry["address"]) for name, entry in data["servers"].items()}
        queues = [queue_config_from_spec(str(q["name"]), q.get("spec", {})) for q in data["queues"]]
        placement = {
            str(q): [[str(s) for s in replicas] for replicas in shards] for q, shards in data["placement"].items()
        }
        duration = int(data.get("lease_duration_ms", DEFAULT_LEASE_DURATION_MS))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a valid cluster file ({error})") from None
    for config in queues:
        shards = placement.get(config.name)
        if shards is None or len(shards) != config.shards:
            raise ValueError(f"{path}: queue {config.name!r} needs a placement for each of its {config.shards} shards")
        for index, replicas in enumerate(shards):
            unknown = [server for server in replicas if server not in servers]
            if unknown or not replicas or len(set(replicas)) != len(replicas):
                raise ValueError(
                    f"{path}: {config.name} shard {index}: replicas {replicas} must be distinct known servers"
                )
    return ClusterFile(servers, queues, placement, duration)
