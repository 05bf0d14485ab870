"""The ReplicationService servicer: appends and snapshots between replicas, and status."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from shard_server.runtime.hosting import QueueHost
from shard_server.runtime.replicating import ShardReplica
from shardq.api.v1 import replication_pb2, replication_pb2_grpc

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class ReplicationServicer(replication_pb2_grpc.ReplicationServiceServicer):
    def __init__(self, host: QueueHost, *, server_id: str, address: str) -> None:
        self.host = host
        self.server_id = server_id
        self.address = address

    def _replica(self, queue: str, shard: int) -> ShardReplica | None:
        hosted = self.host.queues.get(queue)
        local = hosted.by_index.get(shard) if hosted is not None else None
        return local.replica if local is not None else None

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
        replicas = [
            shard.replica.status()
            for queue in self.host.queues.values()
            for shard in queue.shards
            if shard.replica is not None
        ]
        return replication_pb2.ReplicaStatusList(
            server_id=self.server_id, address=self.address, pid=os.getpid(), replicas=replicas
        )
