"""Routing requests to shard leaders on other servers of the cluster.

Any server accepts any request: what it cannot serve itself it forwards to the
shard's leader, marking the call as forwarded so the leader never forwards it
again (a stale view then ends in NOT_LEADER instead of a loop).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from shardq.api.v1 import queue_pb2_grpc
from shardq.coordination.cluster_map import ClusterMap, lease_name
from shardq.coordination.leases import LeaseStore
from shardq.coordination.placement import ShardId

log = logging.getLogger(__name__)

FORWARDED_HEADER = "shardq-forwarded"
FORWARDED = ((FORWARDED_HEADER, "1"),)
ROUTE_REFRESH_S = 0.2
# Peers restart and fail over within seconds: reconnect quickly rather than
# with gRPC's default backoff, which grows to two minutes.
PEER_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class Router:
    def __init__(self, cluster: ClusterMap, leases: LeaseStore, *, server_id: str) -> None:
        self.cluster = cluster
        self.server_id = server_id
        self._leases = leases
        self._stubs: dict[str, queue_pb2_grpc.QueueServiceAsyncStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        # (queue, shard) -> (leader server id, epoch)
        self.routes: dict[tuple[str, int], tuple[str, int]] = {}

    def leader_of(self, queue: str, shard: int) -> tuple[str, int]:
        return self.routes.get((queue, shard), ("", 0))

    def address_of(self, server_id: str) -> str:
        return self.cluster.address_of(server_id)

    def stub_for(self, server_id: str) -> queue_pb2_grpc.QueueServiceAsyncStub:
        stub = self._stubs.get(server_id)
        if stub is None:
            channel = grpc.aio.insecure_channel(
                self.cluster.servers[server_id].address,
                options=PEER_CHANNEL_OPTIONS,
            )
            self._channels.append(channel)
            stub = self._stubs[server_id] = queue_pb2_grpc.QueueServiceStub(channel)
        return stub

    def refresh(self) -> None:
        routes = {}
        for config in self.cluster.queue_configs():
            for shard in range(config.shards):
                lease = self._leases.get(lease_name(ShardId(config.name, shard)))
                if lease is not None and lease.holder:
                    routes[(config.name, shard)] = (lease.holder, lease.transitions)
        self.routes = routes

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:
                log.exception("refreshing shard routes failed")
            await asyncio.sleep(ROUTE_REFRESH_S)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
