"""Channels to the other servers of the cluster, for replication."""

from __future__ import annotations

import grpc

from shard_server.runtime.forwarding import PEER_CHANNEL_OPTIONS
from shardq.api.v1 import replication_pb2_grpc
from shardq.coordination.cluster_map import ClusterMap
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.tls import ClientTls, aio_channel


class PeerChannels:
    """One gRPC channel per peer server, shared by every replica of this server."""

    def __init__(
        self, cluster: ClusterMap, *, credential: PeerCredential = NO_PEER_SECRET, tls: ClientTls | None = None
    ) -> None:
        self.cluster = cluster
        # How peers are reached: over TLS when the servers serve it.
        self.tls = tls
        # What every call to a peer carries (the peer secret, if the cluster has one).
        self.metadata = credential.metadata
        self._stubs: dict[str, replication_pb2_grpc.ReplicationServiceAsyncStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, server_id: str) -> replication_pb2_grpc.ReplicationServiceAsyncStub:
        stub = self._stubs.get(server_id)
        if stub is None:
            channel = aio_channel(self.cluster.servers[server_id].address, self.tls, PEER_CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[server_id] = replication_pb2_grpc.ReplicationServiceStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
