"""Every queue a server hosts, opened from one data directory (runtime.hosting holds each
queue, runtime.hosted_shards each shard)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterable

from shard_server.runtime.committing import WriterThreads
from shard_server.runtime.forwarding import Router
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.storage.lmdb_store import DEFAULT_MAP_SIZE
from shardq.coordination.cluster_map import ClusterMap
from shardq.errors import QueueNotFound
from shardq.queues import QueueConfig, check_queue_name

log = logging.getLogger(__name__)


class QueueHost:
    """Every queue this server hosts, opened from one data directory.

    Standalone: `configs` are all hosted whole. Cluster mode (`cluster` given):
    every queue of the cluster file is known, and the shards placed on
    `server_id` are hosted here as replicas.
    """

    def __init__(
        self,
        data_dir: pathlib.Path,
        configs: Iterable[QueueConfig],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        writer_threads: int = 1,
        commit_ahead: bool = True,
        cluster: ClusterMap | None = None,
        server_id: str = "",
        router: Router | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.cluster = cluster
        self.server_id = server_id
        self.router = router
        # What DescribeQueue names as every shard's leader when standalone; set
        # by the server once bound.
        self.advertised_address = ""
        self.queues: dict[str, HostedQueue] = {}
        self.map_size = map_size
        self.writers = WriterThreads(writer_threads, commit_ahead=commit_ahead)
        for config in configs:
            if config.name in self.queues:
                raise ValueError(f"queue {config.name!r} is configured twice")
            local = None
            if cluster is not None:
                local = cluster.shards_on(server_id, config.name)
            self.queues[config.name] = HostedQueue(
                config,
                data_dir / "queues" / config.name,
                map_size=map_size,
                writers=self.writers,
                local_shards=local,
                router=router,
                uid="" if cluster is None else cluster.queue_uid(config.name),
            )
        for queue in self.queues.values():
            dead_letter_queue = queue.config.dead_letter_queue
            if dead_letter_queue and dead_letter_queue not in self.queues:
                log.warning(
                    "queue %s: dead-letter queue %s is not hosted here; dead letters stay pending until it is",
                    queue.config.name,
                    dead_letter_queue,
                )

    def open_queue(self, config: QueueConfig) -> HostedQueue:
        """Host a queue created at run time: all its shards when standalone, the shards
        the cluster map places here in cluster mode (set the new map first)."""
        if config.name in self.queues:
            raise ValueError(f"queue {config.name!r} is hosted already")
        local = None if self.cluster is None else self.cluster.shards_on(self.server_id, config.name)
        queue = HostedQueue(
            config,
            self.data_dir / "queues" / config.name,
            map_size=self.map_size,
            writers=self.writers,
            local_shards=local,
            router=self.router,
            uid="" if self.cluster is None else self.cluster.queue_uid(config.name),
        )
        self.queues[config.name] = queue
        return queue

    def set_cluster(self, cluster: ClusterMap) -> None:
        """Run with a new cluster map: routes and peers (new queues are opened apart)."""
        self.cluster = cluster
        if self.router is not None:
            self.router.cluster = cluster

    def get(self, name: str) -> HostedQueue:
        queue = self.queues.get(name)
        if queue is None:
            check_queue_name(name)  # before echoing it back in an error
            raise QueueNotFound(name)
        return queue

    def shard_stats_sources(self) -> list[tuple[str, int, HostedShard]]:
        # A snapshot of the table first: the metrics thread calls this while queues
        # may be created or deleted on the event loop.
        queues = list(self.queues.values())
        return [(queue.config.name, shard.index, shard) for queue in queues for shard in queue.shards]

    def routes(self, queue: HostedQueue) -> list[tuple[int, str, int]]:
        """(shard, leader address, epoch) for every shard of the queue."""
        if self.router is None:
            return [(shard.index, self.advertised_address, shard.epoch) for shard in queue.shards]
        routes = []
        for index in range(queue.config.shards):
            leader, epoch = self.router.leader_of(queue.config.name, index)
            routes.append((index, self.router.address_of(leader), epoch))
        return routes

    async def close(self) -> None:
        for queue in self.queues.values():
            await queue.close()
        self.writers.shutdown()
