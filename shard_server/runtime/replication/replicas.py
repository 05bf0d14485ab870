"""Every replica this server hosts, and the task that runs each."""

from __future__ import annotations

import asyncio
import functools

import grpc

from shard_server.runtime.forwarding import Router
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.replication.peers import PeerChannels
from shard_server.runtime.replication.replica import ShardReplica
from shardq.api.v1 import replication_pb2
from shardq.coordination.cluster_map import ClusterMap
from shardq.coordination.leases import LeaseStore

LEADER_POLL_S = 0.05


class Replicas:
    """Every hosted shard's replica, and the task that runs it."""

    def __init__(self, *, server_id: str, leases: LeaseStore, peers: PeerChannels) -> None:
        self.server_id = server_id
        self.leases = leases
        self.peers = peers
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._replicas: dict[tuple[str, int], ShardReplica] = {}

    def get(self, queue: str, shard: int) -> ShardReplica | None:
        return self._replicas.get((queue, shard))

    def all(self) -> list[ShardReplica]:
        return list(self._replicas.values())

    def out_of_sync(self) -> list[str]:
        """The hosted replicas that are not in sync yet (see ShardReplica.in_sync), by name."""
        return sorted(replica.name for replica in self._replicas.values() if not replica.in_sync)

    def start_queue(self, queue: HostedQueue, cluster: ClusterMap) -> None:
        for shard in queue.shards:
            self.start_shard(queue, shard, cluster)

    def start_shard(self, queue: HostedQueue, shard: HostedShard, cluster: ClusterMap) -> None:
        replica = shard.replica = self._replicas[(queue.config.name, shard.index)] = ShardReplica(
            shard,
            server_id=self.server_id,
            cluster=cluster,
            leases=self.leases,
            peers=self.peers,
            reopen=functools.partial(queue.open_environment, shard.index),
        )
        self._tasks[(queue.config.name, shard.index)] = asyncio.create_task(replica.run())

    async def stop_queue(self, queue: HostedQueue) -> None:
        for shard in queue.shards:
            await self.stop_shard(queue.config.name, shard.index, "the queue was removed from the cluster map")

    async def stop_shard(self, queue: str, index: int, why: str) -> None:
        task = self._tasks.pop((queue, index), None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        replica = self._replicas.pop((queue, index), None)
        if replica is not None:
            await replica.step_down(why)

    def use_cluster(self, cluster: ClusterMap) -> None:
        self.peers.cluster = cluster
        for replica in self._replicas.values():
            replica.use_cluster(cluster)

    async def wait_until_led(self, queue: HostedQueue, router: Router, *, timeout_s: float) -> bool:
        """Wait until every shard of a new queue has a leader that serves it, so the first
        send after CreateQueue answers is accepted; False if that took longer than `timeout_s`."""
        name = queue.config.name
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            await asyncio.to_thread(router.refresh)
            if all([await self._serves(router, name, index) for index in range(queue.config.shards)]):
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(LEADER_POLL_S)

    async def _serves(self, router: Router, queue: str, index: int) -> bool:
        leader, epoch = router.leader_of(queue, index)
        if not leader:
            return False
        try:
            status = await self.peers.stub(leader).GetReplicaStatus(
                replication_pb2.GetReplicaStatusRequest(), metadata=self.peers.metadata, timeout=LEADER_POLL_S * 20
            )
        except grpc.RpcError:
            return False
        return any(
            replica.queue == queue
            and replica.shard == index
            and replica.role == replication_pb2.REPLICA_ROLE_LEADER
            and replica.epoch >= epoch
            for replica in status.replicas
        )

    async def hand_off_all(self) -> int:
        """Hand every shard led here to an in-sync follower (graceful shutdown); how many."""
        heirs = await asyncio.gather(*(replica.hand_off() for replica in self._replicas.values()))
        return sum(1 for heir in heirs if heir)

    async def stop_all(self, why: str) -> None:
        """Stop every replica's task, then step down wherever this server leads."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.step_down(why)
