"""The ReplicationService servicer: appends and snapshots between replicas, and status."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from shard_server.runtime.replication.replica import ShardReplica
from shard_server.runtime.replication.replicas import Replicas
from shard_server.service.errors import abort_with
from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.errors import NotAPeer

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class ReplicationServicer(replication_pb2_grpc.ReplicationServiceServicer):
    """Only the cluster's servers (and its supervisor or operator) call here: when the
    server has a peer secret, a call without it is refused before anything is done."""

    def __init__(
        self, replicas: Replicas, *, server_id: str, address: str, credential: PeerCredential = NO_PEER_SECRET
    ) -> None:
        self.replicas = replicas
        self.server_id = server_id
        self.address = address
        self.credential = credential

    async def _only_from_peers(self, context: Context) -> None:
        """Ends the call (abort raises) unless it carries the peer secret."""
        if not self.credential.admits(context.invocation_metadata()):
            refused = NotAPeer("replication calls are taken only from the cluster's servers (peer secret)")
            await abort_with(context, refused)

    def _replica(self, queue: str, shard: int) -> ShardReplica | None:
        return self.replicas.get(queue, shard)

    async def Append(self, request: replication_pb2.AppendRequest, context: Context) -> replication_pb2.AppendResponse:
        await self._only_from_peers(context)
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
        await self._only_from_peers(context)
        replica = self._replica(request.queue, request.shard)
        if replica is None or request.requester_id not in replica.replicas:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a replica of that shard")
            return
        async for chunk in replica.snapshot():
            yield chunk

    async def GetReplicaStatus(
        self, request: replication_pb2.GetReplicaStatusRequest, context: Context
    ) -> replication_pb2.ReplicaStatusList:
        await self._only_from_peers(context)
        replicas = [replica.status() for replica in self.replicas.all()]
        return replication_pb2.ReplicaStatusList(
            server_id=self.server_id, address=self.address, pid=os.getpid(), replicas=replicas
        )
