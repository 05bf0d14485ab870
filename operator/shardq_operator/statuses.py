"""What the servers say about the shards they lead (GetReplicaStatus): load for
rebalancing, commit index and depth for the Shard objects' status."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import grpc

from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.peer_credentials import PeerCredential
from shardq.coordination.placement import ShardId
from shardq.tls import ClientTls, blocking_channel

STATUS_TIMEOUT_S = 2.0
# How the operator speaks TLS to each server it calls (by address; one not in it serves plaintext).
TlsByAddress = Mapping[str, ClientTls]


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderReport:
    """One shard as its leader reports it."""

    load: float  # requests per second over the last few seconds
    commit_index: int
    messages: int


def leader_reports(
    addresses: Iterable[str], credential: PeerCredential, tls: TlsByAddress | None = None
) -> dict[ShardId, LeaderReport]:
    """Every shard led by one of the servers at `addresses`, asked with the cluster's peer
    secret, over TLS to those `tls` has settings for; servers that do not answer are left
    out (their shards then count as idle: no move is made for them)."""
    reports: dict[ShardId, LeaderReport] = {}
    for address in addresses:
        with blocking_channel(address, (tls or {}).get(address)) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            try:
                answer = stub.GetReplicaStatus(
                    replication_pb2.GetReplicaStatusRequest(), metadata=credential.metadata, timeout=STATUS_TIMEOUT_S
                )
            except grpc.RpcError:
                continue
        for replica in answer.replicas:
            if replica.role == replication_pb2.REPLICA_ROLE_LEADER:
                reports[ShardId(replica.queue, replica.shard)] = LeaderReport(
                    load=replica.load, commit_index=replica.commit_index, messages=replica.messages
                )
    return reports
