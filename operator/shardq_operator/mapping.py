"""The cluster map a ShardqCluster and its Queues stand for (pure).

Placement is sticky: a queue already in the map keeps its replicas (only replica moves,
`shardq.coordination.replica_moves`, change them); a new queue is placed by the planner
the local supervisor uses (`shardq.coordination`); a removed Queue leaves the map.
Whatever cannot be applied is reported per queue, and the map keeps what it had for
that queue.
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


def queue_entry(name: str, spec: Mapping[str, Any], uid: str = "") -> QueueEntry:
    """The queue a Queue resource specifies (`uid`: the resource's); ValueError naming the bad setting."""
    entry = QueueEntry(name, {key: value for key, value in spec.items() if key not in _NOT_SETTINGS}, uid=uid)
    entry.config  # noqa: B018 -- parsing is the validation
    return entry


@dataclasses.dataclass(frozen=True)
class DesiredMap:
    cluster_map: ClusterMap
    # queue -> why its resource could not be applied as written (the map keeps what it had).
    problems: dict[str, str]


def servers_needed(cluster: str, servers: int, placement: Mapping[str, list[list[str]]]) -> int:
    """Pods the StatefulSet must have: the spec's servers, or more while a server beyond
    them still holds replicas (a scale-in waits until they have moved off)."""
    prefix = naming.server_set(cluster) + "-"
    referenced = {server for shards in placement.values() for replicas in shards for server in replicas}
    ordinals = [int(server.removeprefix(prefix)) for server in referenced if server.startswith(prefix)]
    return max(servers, max(ordinals, default=-1) + 1)


def with_servers(cluster: ClusterMap, *, name: str, namespace: str, count: int) -> ClusterMap:
    """`cluster` naming the first `count` servers of the StatefulSet."""
    return dataclasses.replace(
        cluster,
        servers={
            server_id: ServerEntry(server_id, naming.server_address(name, namespace, server_id))
            for server_id in naming.server_ids(name, count)
        },
    )


def desired_map(
    *,
    cluster: str,
    namespace: str,
    servers: int,
    lease_duration_ms: int,
    queues: Mapping[str, Mapping[str, Any]],
    current: ClusterMap | None,
    uids: Mapping[str, str] | None = None,
) -> DesiredMap:
    """The map for `queues` (name -> Queue spec) on a cluster of `servers` pods. New
    queues go on those; servers beyond them stay in the map while they hold replicas
    (`shardq.coordination.replica_moves` moves those off). `uids` (name -> the Queue's
    metadata.uid) tell the servers which creation of a queue of that name each is."""
    problems: dict[str, str] = {}
    placement = current.placement if current is not None else {}
    result = with_servers(
        ClusterMap(
            servers={},
            queues=list(current.queues) if current is not None else [],
            placement=dict(placement),
            lease_duration_ms=lease_duration_ms,
        ),
        name=cluster,
        namespace=namespace,
        count=servers_needed(cluster, servers, placement),
    )
    staying = naming.server_ids(cluster, servers)
    wanted: dict[str, QueueEntry] = {}
    for name, spec in sorted(queues.items()):
        try:
            wanted[name] = queue_entry(name, spec, (uids or {}).get(name, ""))
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
                result = with_queue_added(result, entry, on=staying)
            elif present.spec != entry.spec or (entry.uid and entry.uid != present.uid):
                # A uid differs when the map was written before uids (servers take it as
                # the data's), or for a Queue made again under the name (servers drop
                # the old one's data): the finalizer keeps the name until the map drops
                # it, so only a map edited by hand gets here.
                result = with_queue_changed(result, entry)
        except ValueError as error:
            problems[name] = str(error)
    return DesiredMap(cluster_map=result, problems=problems)
