"""The cluster map a ShardqCluster and its Queues stand for (pure).

Placement is sticky: a queue already in the map keeps its replicas; a new queue is
placed by the planner the local supervisor uses (`shardq.coordination`); a removed
Queue leaves the map. Whatever cannot be applied is reported per queue, and the map
keeps what it had for that queue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardq.coordination.cluster_map import (
    ClusterMap,
    QueueEntry,
    ServerEntry,
    with_queue_added,
    with_queue_changed,
    with_queue_removed,
)
from shardq_operator import naming

# Queue resource fields that are not queue settings.
_NOT_SETTINGS = {"cluster"}


def queue_entry(name: str, spec: Mapping[str, Any]) -> QueueEntry:
    """The queue a Queue resource specifies; ValueError naming the bad setting."""
    entry = QueueEntry(name, {key: value for key, value in spec.items() if key not in _NOT_SETTINGS})
    entry.config  # noqa: B018 -- parsing is the validation
    return entry


@dataclasses.dataclass(frozen=True)
class DesiredMap:
    cluster_map: ClusterMap
    # Pods the StatefulSet must have: the spec's servers, or more while replicas still live beyond them.
    servers: int
    # queue -> why its resource could not be applied as written (the map keeps what it had).
    problems: dict[str, str]
    # Why the cluster itself is not as specified, if it is not.
    cluster_problem: str = ""


def desired_map(
    *,
    cluster: str,
    namespace: str,
    servers: int,
    lease_duration_ms: int,
    queues: Mapping[str, Mapping[str, Any]],
    current: ClusterMap | None,
) -> DesiredMap:
    """The map for `queues` (name -> Queue spec) on a cluster of `servers` pods."""
    problems: dict[str, str] = {}
    cluster_problem = ""
    needed = servers
    if current is not None:
        referenced = {server for shards in current.placement.values() for replicas in shards for server in replicas}
        prefix = naming.server_set(cluster) + "-"
        ordinals = [int(server.removeprefix(prefix)) for server in referenced if server.startswith(prefix)]
        highest = max(ordinals, default=-1) + 1
        if highest > servers:
            needed = highest
            cluster_problem = (
                f"scaling down to {servers} servers needs replicas moved off the others first, which this "
                f"operator does not do yet; keeping {highest}"
            )
    server_entries = {
        server_id: ServerEntry(server_id, naming.server_address(cluster, namespace, server_id))
        for server_id in naming.server_ids(cluster, needed)
    }
    result = ClusterMap(
        servers=server_entries,
        queues=list(current.queues) if current is not None else [],
        placement=dict(current.placement) if current is not None else {},
        lease_duration_ms=lease_duration_ms,
    )
    wanted: dict[str, QueueEntry] = {}
    for name, spec in sorted(queues.items()):
        try:
            wanted[name] = queue_entry(name, spec)
        except ValueError as error:
            problems[name] = str(error)
    for existing in list(result.queues):
        if existing.name not in queues:
            try:
                result = with_queue_removed(result, existing.name)
            except ValueError as error:  # still another queue's dead-letter queue
                problems[existing.name] = f"cannot be removed yet: {error}"
    for name, entry in wanted.items():
        present = next((queue for queue in result.queues if queue.name == name), None)
        try:
            if present is None:
                result = with_queue_added(result, entry)
            elif present.spec != entry.spec:
                result = with_queue_changed(result, entry)
        except ValueError as error:
            problems[name] = str(error)
    return DesiredMap(cluster_map=result, servers=needed, problems=problems, cluster_problem=cluster_problem)
