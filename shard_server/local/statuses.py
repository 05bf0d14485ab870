"""What `shardq local status` shows, built from what it read: pure, so dead servers are just absent facts.

Leaders, epochs and in-sync sets come from the lease store, which is the truth for
fencing; commit index and load come from the servers' own reports, when they answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shard_server.local.cluster_files import SupervisorRecord
from shard_server.local.observing import ServerReport
from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.fencing import is_expired, isr_of
from shardq.coordination.leases import LeaseRecord


@dataclasses.dataclass(frozen=True, slots=True)
class ServerStatus:
    server_id: str
    endpoint: str
    metrics_endpoint: str
    pid: int | None
    alive: bool
    answering: bool  # answered GetReplicaStatus just now
    replicas: int | None  # how many replicas it reports hosting
    leads: int  # shards whose lease it holds


@dataclasses.dataclass(frozen=True, slots=True)
class ShardStatus:
    queue: str
    shard: int
    lease: str
    replicas: tuple[str, ...]
    leader: str | None
    epoch: int | None
    lease_expired: bool | None
    isr: tuple[str, ...]
    commit_index: int | None
    load: float | None
    roles: dict[str, str]  # server id -> role, for the replicas that answered


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterStatus:
    supervisor_pid: int | None
    supervisor_alive: bool
    servers: tuple[ServerStatus, ...]
    shards: tuple[ShardStatus, ...]


def build_cluster_status(
    *,
    cluster: ClusterMap,
    record: SupervisorRecord | None,
    supervisor_alive: bool,
    alive_pids: frozenset[int],
    leases: Mapping[str, LeaseRecord],
    reports: Mapping[str, ServerReport],
    now_ms: int,
) -> ClusterStatus:
    servers: list[ServerStatus] = []
    for server_id, entry in sorted(cluster.servers.items()):
        supervised = record.servers.get(server_id) if record is not None else None
        pid = supervised.pid if supervised is not None and supervised.pid else None
        report = reports.get(server_id)
        servers.append(
            ServerStatus(
                server_id=server_id,
                endpoint=entry.address,
                metrics_endpoint=entry.metrics_address,
                pid=report.pid if report is not None and report.pid else pid,
                alive=report is not None or (pid is not None and pid in alive_pids),
                answering=report is not None,
                replicas=len(report.replicas) if report is not None else None,
                leads=sum(1 for lease in leases.values() if lease.holder == server_id),
            )
        )
    shards: list[ShardStatus] = []
    for shard in cluster.shards():
        lease = leases.get(lease_name(shard))
        roles = {
            server_id: replica.role
            for server_id, report in sorted(reports.items())
            for replica in report.replicas
            if replica.shard == shard
        }
        leader_replica = None
        if lease is not None and lease.holder in reports:
            leader_replica = next((r for r in reports[lease.holder].replicas if r.shard == shard), None)
        shards.append(
            ShardStatus(
                queue=shard.queue,
                shard=shard.index,
                lease=lease_name(shard),
                replicas=cluster.replicas_of(shard),
                leader=(lease.holder or None) if lease is not None else None,
                epoch=lease.transitions if lease is not None else None,
                lease_expired=is_expired(lease, now_ms) if lease is not None else None,
                isr=tuple(sorted(isr_of(lease))) if lease is not None else (),
                commit_index=leader_replica.commit_index if leader_replica is not None else None,
                load=leader_replica.load if leader_replica is not None else None,
                roles=roles,
            )
        )
    return ClusterStatus(
        supervisor_pid=record.pid if record is not None else None,
        supervisor_alive=supervisor_alive,
        servers=tuple(servers),
        shards=tuple(shards),
    )


def cluster_status_to_json(status: ClusterStatus) -> dict[str, Any]:
    return dataclasses.asdict(status)


def format_cluster_status(status: ClusterStatus) -> str:
    if status.supervisor_pid is None:
        supervisor = "supervisor: not running"
    else:
        state = "running" if status.supervisor_alive else "gone (killed?)"
        supervisor = f"supervisor: pid {status.supervisor_pid} {state}"
    lines = [supervisor, "", f"{'SERVER':<8}{'ENDPOINT':<18}{'PID':>8}  {'ALIVE':<6}{'ANSWERS':<9}{'LEADS':>5}"]
    for server in status.servers:
        lines.append(
            f"{server.server_id:<8}{server.endpoint:<18}{server.pid or '-':>8}  "
            f"{'yes' if server.alive else 'no':<6}{'yes' if server.answering else 'no':<9}{server.leads:>5}"
        )
    lines += ["", f"{'SHARD':<16}{'LEADER':<8}{'EPOCH':>6}  {'IN-SYNC':<16}{'COMMIT':>10}{'LOAD/S':>9}  NOTE"]
    for shard in status.shards:
        note = "lease expired" if shard.lease_expired else ""
        if shard.leader is not None and shard.roles and shard.roles.get(shard.leader) != "leader":
            note = (note + "; " if note else "") + f"leader reports {shard.roles.get(shard.leader, 'nothing')}"
        commit = "-" if shard.commit_index is None else str(shard.commit_index)
        load = "-" if shard.load is None else f"{shard.load:.1f}"
        lines.append(
            f"{shard.lease:<16}{shard.leader or '-':<8}{shard.epoch if shard.epoch is not None else '-':>6}  "
            f"{','.join(shard.isr) or '-':<16}{commit:>10}{load:>9}  {note}"
        )
    return "\n".join(lines)
