"""What the servers say about their replicas (GetReplicaStatus), for rebalancing."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.placement import ShardId

STATUS_TIMEOUT_S = 2.0


def leader_loads(addresses: Iterable[str]) -> dict[ShardId, float]:
    """Requests per second of every shard, as its leader reports it; servers that do not
    answer are left out (their shards then count as idle: no move is made for them)."""
    loads: dict[ShardId, float] = {}
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            try:
                answer = stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError:
                continue
        for replica in answer.replicas:
            if replica.role == replication_pb2.REPLICA_ROLE_LEADER:
                loads[ShardId(replica.queue, replica.shard)] = replica.load
    return loads
