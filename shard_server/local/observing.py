"""Asking servers how their replicas stand (ReplicationService.GetReplicaStatus), all at once.

A dead or hung server must not hold up the supervisor's loop or `status`: each call has
a short deadline, the calls run in parallel, and a server that does not answer is
simply missing from the result.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping

import grpc

from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.peer_credentials import PeerCredential
from shardq.coordination.placement import ShardId

STATUS_TIMEOUT_S = 1.0

_ROLES = {
    replication_pb2.REPLICA_ROLE_LEADER: "leader",
    replication_pb2.REPLICA_ROLE_FOLLOWER: "follower",
    replication_pb2.REPLICA_ROLE_RECOVERING: "recovering",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaReport:
    server_id: str
    shard: ShardId
    role: str
    epoch: int
    last_index: int
    commit_index: int
    applied_index: int
    isr: tuple[str, ...]
    load: float
    messages: int


@dataclasses.dataclass(frozen=True, slots=True)
class ServerReport:
    server_id: str
    address: str
    pid: int
    replicas: tuple[ReplicaReport, ...]


def server_report_from_proto(reply: replication_pb2.ReplicaStatusList) -> ServerReport:
    return ServerReport(
        server_id=reply.server_id,
        address=reply.address,
        pid=reply.pid,
        replicas=tuple(
            ReplicaReport(
                server_id=reply.server_id,
                shard=ShardId(replica.queue, replica.shard),
                role=_ROLES.get(replica.role, "unknown"),
                epoch=replica.epoch,
                last_index=replica.last_index,
                commit_index=replica.commit_index,
                applied_index=replica.applied_index,
                isr=tuple(replica.isr),
                load=replica.load,
                messages=replica.messages,
            )
            for replica in reply.replicas
        ),
    )


def fetch_replica_status(
    address: str, *, credential: PeerCredential, timeout_s: float = STATUS_TIMEOUT_S
) -> ServerReport | None:
    """One server's report, or None if it did not answer within `timeout_s`."""
    with grpc.insecure_channel(address) as channel:
        stub = replication_pb2_grpc.ReplicationServiceStub(channel)
        try:
            reply = stub.GetReplicaStatus(
                replication_pb2.GetReplicaStatusRequest(), metadata=credential.metadata, timeout=timeout_s
            )
        except grpc.RpcError:
            return None
    return server_report_from_proto(reply)


def fetch_all_replica_status(
    addresses: Mapping[str, str], *, credential: PeerCredential, timeout_s: float = STATUS_TIMEOUT_S
) -> dict[str, ServerReport]:
    """Reports by server id from every server that answered."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        futures = {
            server_id: pool.submit(fetch_replica_status, address, credential=credential, timeout_s=timeout_s)
            for server_id, address in addresses.items()
        }
        reports = {server_id: future.result() for server_id, future in futures.items()}
    return {server_id: report for server_id, report in reports.items() if report is not None}


def compute_shard_loads(reports: Mapping[str, ServerReport], leaders: Mapping[ShardId, str]) -> dict[ShardId, float]:
    """Each shard's load as its leader reports it (followers serve no client requests)."""
    loads: dict[ShardId, float] = {}
    for shard, leader in leaders.items():
        report = reports.get(leader)
        if report is None:
            continue
        for replica in report.replicas:
            if replica.shard == shard and replica.role == "leader":
                loads[shard] = replica.load
    return loads
