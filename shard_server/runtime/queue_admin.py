"""Creating, deleting and changing queues while a standalone server runs.

The queues given on the command line (or in --config) are static: they are
defined there and changed there. Queues created at run time are persisted in
the data directory's catalog and opened again at every start. A local
cluster's servers change the cluster map instead (`ClusterMapFile`), and every
server of the cluster, this one first, applies the new map. A server whose
queues are defined elsewhere (the operator's Queue resources) refuses all
three operations and names that place.

Each hosted queue has background tasks (housekeeping per shard, the
dead-letter mover); this module starts and stops them with the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence

from shard_server.runtime import background
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.map_following import ClusterMapFile, ClusterMapFollower, ClusterMapLocked
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.storage.queue_catalog import QueueCatalog
from shardq.coordination.cluster_map import (
    ClusterMap,
    QueueEntry,
    new_queue_uid,
    with_queue_added,
    with_queue_changed,
    with_queue_removed,
)
from shardq.errors import InvalidArgument, QueueExists, QueueInUse, QueueManagedElsewhere, Reason, ShardqError
from shardq.queues import QueueConfig, check_queue_name, merged_spec, queue_config_from_spec

log = logging.getLogger(__name__)

# Settings fixed at creation: changing them would move messages between shards
# or change the queue's ordering promise.
# How long CreateQueue in a cluster waits for the new shards' leaders to serve.
LEADERS_WAIT_S = 10.0
IMMUTABLE_SETTINGS = {"shards": "shards", "fifo": "fifo", "replicas": "replicas"}


def parse_settings(name: str, settings: Mapping[str, str]) -> QueueConfig:
    try:
        return queue_config_from_spec(name, dict(settings))
    except ValueError as error:
        raise InvalidArgument("settings", str(error)) from None


def runtime_configs(catalog: QueueCatalog, static: set[str]) -> list[QueueConfig]:
    """The catalog's queues to open at start (a static queue of the same name wins)."""
    configs = []
    for name, settings in catalog.load().items():
        if name in static:
            log.warning("queue %s is defined on the command line now: its runtime settings are ignored", name)
            continue
        configs.append(queue_config_from_spec(name, settings))
    return configs


class QueueAdmin:
    def __init__(
        self,
        host: QueueHost,
        *,
        catalog: QueueCatalog,
        static: set[str],
        managed_by: str | None,
    ) -> None:
        self.host = host
        self.catalog = catalog
        self.static = static
        # Where the queues are defined when not here (e.g. "the cluster file /x/cluster.json").
        self.managed_by = managed_by
        # Per queue its dead-letter mover; per (queue, shard) its housekeeping.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._shard_tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        # Cluster mode: the shared map file, and this server's follower of it.
        self.map_file: ClusterMapFile | None = None
        self.follower: ClusterMapFollower | None = None

    def open_hosted(self, queue: HostedQueue) -> None:
        """Start the background tasks of a queue just opened."""
        self._tasks[queue.config.name] = asyncio.create_task(background.move_dead_letters(self.host, queue))
        for shard in queue.shards:
            self.open_shard(queue, shard)

    def open_shard(self, queue: HostedQueue, shard: HostedShard) -> None:
        """Start the housekeeping of a shard opened here."""
        self._shard_tasks[(queue.config.name, shard.index)] = asyncio.create_task(background.keep_shard_tidy(shard))

    async def close_shard(self, queue: HostedQueue, index: int) -> None:
        """Stop a shard's housekeeping, then stop hosting it and delete its data here."""
        await _cancelled([self._shard_tasks.pop((queue.config.name, index), None)])
        await queue.remove_shard(index)

    async def close_hosted(self, name: str) -> int:
        """Stop hosting queue `name` and delete its data here; how many messages it held here."""
        queue = self.host.queues.pop(name)
        await queue.until_committed()  # the count takes in sends answered ahead of LMDB's commit
        messages = sum(shard.message_count() for shard in queue.shards)
        await _cancelled(
            [self._tasks.pop(name, None), *(self._shard_tasks.pop((name, shard.index), None) for shard in queue.shards)]
        )
        queue.wake()  # long polls end (and find the queue gone)
        await queue.close()
        await asyncio.to_thread(shutil.rmtree, queue.directory, True)
        return messages

    async def _change_map(self, change: Callable[[ClusterMap], ClusterMap]) -> None:
        """Write the changed map (under the file's lock) and apply it here before answering."""
        assert self.map_file is not None
        assert self.follower is not None
        try:
            cluster = await asyncio.to_thread(self.map_file.change, change)
        except ValueError as error:
            raise InvalidArgument("settings", str(error)) from None
        except ClusterMapLocked as error:
            raise ShardqError(Reason.CLUSTER_MAP_LOCKED, f"the queue was not changed: {error}") from None
        await self.follower.apply(cluster)

    def start(self) -> None:
        """Start every hosted queue's background tasks."""
        for queue in self.host.queues.values():
            self.open_hosted(queue)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._shard_tasks.values()]
        self._tasks.clear()
        self._shard_tasks.clear()
        await _cancelled(tasks)

    def _refuse_if_managed_elsewhere(self, verb: str, name: str) -> None:
        if self.managed_by is not None:
            raise QueueManagedElsewhere(
                f"this server's queues are defined by {self.managed_by}: {verb} queue {name!r} there"
            )

    def _refuse_what_one_server_cannot_keep(self, config: QueueConfig) -> None:
        """Settings this server would take and not honour. A dead-letter queue that does
        not exist held each dead letter as pending for good, as SQS refuses such a
        policy; replicas on a standalone server were listed and never made."""
        dead_letters = config.dead_letter_queue
        if dead_letters and dead_letters != config.name and dead_letters not in self.host.queues:
            raise InvalidArgument(
                "settings", f"deadLetterQueue: queue {dead_letters!r} does not exist: create it first"
            )
        if config.replicas > 1 and self.map_file is None:
            raise InvalidArgument(
                "settings",
                f"replicas: {config.replicas} copies need a cluster (shardq local up, or the operator); "
                "a standalone server keeps one",
            )

    def _refuse_if_static(self, verb: str, name: str) -> None:
        if name in self.static:
            raise QueueManagedElsewhere(
                f"queue {name!r} is defined by the server's --queue/--config: {verb} it there and restart"
            )

    async def create(self, name: str, settings: Mapping[str, str]) -> tuple[HostedQueue, bool]:
        """(the queue, created now). Creating an existing queue with the same settings
        is a no-op, as in SQS; with other settings it is QUEUE_EXISTS."""
        self._refuse_if_managed_elsewhere("create", name)
        check_queue_name(name)
        config = parse_settings(name, settings)
        async with self._lock:
            existing = self.host.queues.get(name)
            if existing is not None:
                if existing.config != config:
                    raise QueueExists(name)
                return existing, False
            self._refuse_what_one_server_cannot_keep(config)
            if self.map_file is not None:
                entry = QueueEntry(name, dict(settings), uid=new_queue_uid())
                await self._change_map(functools.partial(with_queue_added, queue=entry))
                log.info("created queue %s in the cluster map", name)
                created = self.host.get(name)
                assert self.follower is not None
                assert self.host.router is not None
                if not await self.follower.replicas.wait_until_led(created, self.host.router, timeout_s=LEADERS_WAIT_S):
                    log.warning("queue %s: not every shard had a serving leader after %.0f s", name, LEADERS_WAIT_S)
                return created, True
            saved = self.catalog.load()
            saved[name] = dict(settings)
            queue = await asyncio.to_thread(self.host.open_queue, config)
            self.catalog.save(saved)
            self.open_hosted(queue)
        log.info("created queue %s", name)
        return queue, True

    async def delete(self, name: str) -> int:
        """Delete the queue and its data; returns how many messages it held."""
        self._refuse_if_managed_elsewhere("delete", name)
        queue = self.host.get(name)
        self._refuse_if_static("delete", name)
        users = sorted(other for other, q in self.host.queues.items() if q.config.dead_letter_queue == name)
        if users:
            raise QueueInUse(f"queue {name!r} is the dead-letter queue of {', '.join(users)}: change those first")
        async with self._lock:
            if self.map_file is not None:
                messages = sum(shard.message_count() for shard in queue.shards)
                await self._change_map(functools.partial(with_queue_removed, name=name))
                log.info("deleted queue %s from the cluster map", name)
                return messages
            messages = await self.close_hosted(name)
            saved = self.catalog.load()
            saved.pop(name, None)
            self.catalog.save(saved)
        log.info("deleted queue %s (%d messages)", name, messages)
        return messages

    async def set_attributes(self, name: str, settings: Mapping[str, str]) -> HostedQueue:
        self._refuse_if_managed_elsewhere("change", name)
        queue = self.host.get(name)
        self._refuse_if_static("change", name)
        async with self._lock:
            if self.map_file is not None:
                return await self._change_settings_in_map(queue, settings)
            saved = self.catalog.load()
            merged = merged_spec(saved.get(name, {}), settings)
            config = parse_settings(name, merged)
            self._refuse_what_one_server_cannot_keep(config)
            current = queue.config
            changed = sorted(
                key for key, field in IMMUTABLE_SETTINGS.items() if getattr(config, field) != getattr(current, field)
            )
            if changed:
                raise InvalidArgument(
                    "settings", f"{', '.join(changed)} cannot change after a queue is created (create another queue)"
                )
            saved[name] = merged
            self.catalog.save(saved)
            # Shards read the config for every batch: the next one uses the new settings.
            queue.config = config
        log.info("changed queue %s: %s", name, ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
        return queue

    async def _change_settings_in_map(self, queue: HostedQueue, settings: Mapping[str, str]) -> HostedQueue:
        name = queue.config.name
        cluster = self.host.cluster
        assert cluster is not None
        current = next(entry for entry in cluster.queues if entry.name == name)
        merged = merged_spec(current.spec, settings)
        self._refuse_what_one_server_cannot_keep(parse_settings(name, merged))
        await self._change_map(functools.partial(with_queue_changed, queue=QueueEntry(name, merged)))
        log.info(
            "changed queue %s in the cluster map: %s", name, ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
        )
        return self.host.get(name)


async def _cancelled(tasks: Sequence[asyncio.Task[None] | None]) -> None:
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
