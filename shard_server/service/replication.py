"""The ReplicationService servicer: appends and snapshots between replicas, and status."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from shard_server.runtime.replication.replica import ShardReplica
from shard_server.runtime.replication.replicas import Replicas
from shardq.api.v1 import replication_pb2, replication_pb2_grpc

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class ReplicationServicer(replication_pb2_grpc.ReplicationServiceServicer):
    def __init__(self, replicas: Replicas, *, server_id: str, address: str) -> None:
        self.replicas = replicas
        self.server_id = server_id
        self.address = address

    def _replica(self, queue: str, shard: int) -> ShardReplica | None:
        return self.replicas.get(queue, shard)

    async def Append(self, request: replication_pb2.AppendRequest, context: Context) -> replication_pb2.AppendResponse:
        replica = self._replica(request.queue, request.shard)
        if replica is None:
            return replication_pb2.AppendResponse(
                outcome=replication_pb2.APPEND_OUTCOME_REFUSED,
                detail=f"{request.queue} shard {request.shard} has no replica on {self.server_id}",
            )
        return await replica.append(request)

    async def Snapshot(
        self, request: replication_pb2.SnapshotRequest, context: Context
    ) -> AsyncIterator[replication_pb2.SnapshotChunk]:
        replica = self._replica(request.queue, request.shard)
        if replica is None or request.requester_id not in replica.replicas:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a replica of that shard")
            return
        async for chunk in replica.snapshot():
            yield chunk

    async def GetReplicaStatus(
        self, request: replication_pb2.GetReplicaStatusRequest, context: Context
    ) -> replication_pb2.ReplicaStatusList:
        replicas = [replica.status() for replica in self.replicas.all()]
        return replication_pb2.ReplicaStatusList(
            server_id=self.server_id, address=self.address, pid=os.getpid(), replicas=replicas
        )
