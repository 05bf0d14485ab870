"""Following the cluster map while the server runs: queues added, removed and changed.

The map is a file: `cluster.json` of a local cluster, or the operator's ConfigMap mounted
into the pod (the kubelet swaps the file atomically). The server reads it once a second
and applies what changed without a restart: a new queue's shards placed here are opened
and their replicas start following their leases; a removed queue's replicas stop and its
data is deleted; changed settings apply to the next batch. Changes a running server
cannot make (a queue's shard count, ordering or replication factor) are refused in the log,
and the queue keeps running as it was. Replicas moved between servers (the operator's
`replica_moves`) are opened here empty, or stopped and deleted here.

A local cluster's servers also write the map (runtime queue management), through
`ClusterMapFile`, which holds a lock around read-change-write and creates the new
shards' leases before the map names them. It waits for that lock for MAP_LOCK_WAIT_S at
most: a process stopped while changing the map holds the lock until it goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import pathlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import HostedQueue
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.runtime.replication.replicas import Replicas
from shardq.coordination.cluster_map import (
    ClusterMap,
    MapChange,
    change_between,
    cluster_map_from_text,
    new_shards,
    read_cluster_map,
    write_cluster_map,
)
from shardq.coordination.leases import LeaseStore
from shardq.coordination.new_shard_leases import write_lease_for_new_shard
from shardq.coordination.placement import ShardId

log = logging.getLogger(__name__)

MAP_POLL_S = 1.0
# How long a change waits for the map's lock. A change holds it for a read and a write of
# the file; one held longer is held by a process stopped in the middle (SIGSTOP, a
# debugger), which holds it until it goes on or exits. Waiting for it without end would
# hold the admin call, and this server's later ones, as long.
MAP_LOCK_WAIT_S = 5.0
MAP_LOCK_POLL_S = 0.01


class ClusterMapLocked(Exception):
    """Another process held the cluster map's lock for longer than MAP_LOCK_WAIT_S."""


class MapSource(Protocol):
    """Where the map is read from: a file (`pathlib.Path`) or a ConfigMap."""

    def read_text(self) -> str:
        """The map's text; OSError when it cannot be read now."""


class ClusterMapFollower:
    def __init__(
        self,
        source: MapSource,
        host: QueueHost,
        replicas: Replicas,
        *,
        open_hosted: Callable[[HostedQueue], None],
        close_hosted: Callable[[str], Awaitable[int]],
        open_shard: Callable[[HostedQueue, HostedShard], None],
        close_shard: Callable[[HostedQueue, int], Awaitable[None]],
    ) -> None:
        self.source = source
        self.host = host
        self.replicas = replicas
        self._open_hosted = open_hosted
        self._close_hosted = close_hosted
        self._open_shard = open_shard
        self._close_shard = close_shard
        self._lock = asyncio.Lock()
        self._applied_text = ""
        self._refused_text = ""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(MAP_POLL_S)
            try:
                await self.apply_file()
            except Exception:
                log.exception("applying the cluster map %s failed; retrying", self.source)

    async def apply_file(self) -> ClusterMap | None:
        """Apply the map file if it changed since it was last applied; the map now in force."""
        try:
            text = await asyncio.to_thread(self.source.read_text)
        except OSError as error:
            log.warning("cannot read the cluster map %s: %s; keeping the one in force", self.source, error)
            return None
        if text in (self._applied_text, self._refused_text):
            return None
        try:
            cluster = cluster_map_from_text(text)
        except ValueError as error:
            self._refused_text = text
            log.error("the cluster map %s is not valid (%s); keeping the one in force", self.source, error)
            return None
        await self.apply(cluster)
        self._applied_text = text
        return cluster

    async def apply(self, new: ClusterMap) -> None:
        async with self._lock:
            old = self.host.cluster
            assert old is not None, "only a cluster's servers follow a cluster map"
            change = change_between(old, new)
            effective = _keeping_refused(old, new, change)
            for name, reason in change.refused.items():
                log.error("cluster map: queue %s not changed: %s", name, reason)
            self.host.set_cluster(effective)
            self.replicas.use_cluster(effective)
            for name in change.removed:
                queue = self.host.queues.get(name)
                if queue is not None:
                    await self.replicas.stop_queue(queue)
                    await self._close_hosted(name)
                    log.info("cluster map: queue %s removed; its data here is deleted", name)
            for entry in change.added:
                queue = await asyncio.to_thread(self.host.open_queue, entry.config)
                self.replicas.start_queue(queue, effective)
                self._open_hosted(queue)
                shards = ", ".join(str(shard.index) for shard in queue.shards) or "none"
                log.info("cluster map: queue %s added (shards here: %s)", entry.name, shards)
            for entry in change.changed:
                # Shards read the config for every batch: the next one uses the new settings.
                self.host.queues[entry.name].config = entry.config
                log.info("cluster map: queue %s settings changed", entry.name)
            for entry in effective.queues:
                hosted = self.host.queues.get(entry.name)
                if hosted is not None and entry.uid and not hosted.uid:  # a map from before uids, now naming one
                    await asyncio.to_thread(hosted.adopt_uid, entry.uid)
            for name in change.moved:
                await self._move_replicas(self.host.queues[name], old, effective)

    async def _move_replicas(self, queue: HostedQueue, old: ClusterMap, new: ClusterMap) -> None:
        """Open the replicas a move placed on this server (empty: the leader sends a
        snapshot) and delete the ones that moved away. Leaders already ship to the new
        replica set (`Replicas.use_cluster`)."""
        name = queue.config.name
        me = self.host.server_id
        for index, (was, now) in enumerate(zip(old.placement[name], new.placement[name], strict=True)):
            if me in now and me not in was:
                shard = await asyncio.to_thread(queue.add_shard, index)
                self.replicas.start_shard(queue, shard, new)
                self._open_shard(queue, shard)
                log.info("cluster map: a replica of %s shard %d moved here; copying it from its leader", name, index)
            elif me in was and me not in now:
                await self.replicas.stop_shard(name, index, "the replica moved to another server")
                await self._close_shard(queue, index)
                log.info("cluster map: the replica of %s shard %d moved away; its data here is deleted", name, index)


def _keeping_refused(old: ClusterMap, new: ClusterMap, change: MapChange) -> ClusterMap:
    """`new`, except that queues whose change was refused stay as they were in `old`."""
    if not change.refused:
        return new
    old_entries = {queue.name: queue for queue in old.queues}
    queues = [old_entries[queue.name] if queue.name in change.refused else queue for queue in new.queues]
    placement = {
        name: old.placement[name] if name in change.refused else shards for name, shards in new.placement.items()
    }
    return dataclasses.replace(new, queues=queues, placement=placement)


class ClusterMapFile:
    """The map file a local cluster's servers share, changed under an exclusive lock.

    A change creates the leases of the shards it adds before it writes the map, so a
    server that sees a new shard finds its lease. A queue created again under the name
    of a deleted one continues its leases' epochs: receipts of the old queue never match.
    """

    def __init__(self, path: pathlib.Path, leases: LeaseStore, *, now_ms: Callable[[], int]) -> None:
        self.path = path
        self.leases = leases
        self._now_ms = now_ms

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The map's lock, or ClusterMapLocked, naming who holds it, after MAP_LOCK_WAIT_S."""
        lock_path = self.path.with_name(f".{self.path.name}.lock")
        with lock_path.open("a") as lock:
            if not _flock_within(lock.fileno(), MAP_LOCK_WAIT_S):
                raise ClusterMapLocked(_locked_message(lock_path))
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def change(self, edit: Callable[[ClusterMap], ClusterMap]) -> ClusterMap:
        """Apply `edit` to the map as it is on disk now; the new map (ValueError from
        `edit` leaves the file as it was)."""
        with self._locked():
            current = read_cluster_map(self.path)
            new = edit(current)
            for shard in new_shards(current, new):
                self._lease_for_new_shard(new, shard.queue, shard.index)
            write_cluster_map(self.path, new)
        return new

    def _lease_for_new_shard(self, cluster: ClusterMap, queue: str, index: int) -> None:
        shard = ShardId(queue, index)
        write_lease_for_new_shard(
            self.leases,
            shard=shard,
            replicas=cluster.replicas_of(shard),
            now_ms=self._now_ms,
            duration_ms=cluster.lease_duration_ms,
            queue_uid=cluster.queue_uid(queue),
        )


def _flock_within(fd: int, timeout_s: float) -> bool:
    """Take an exclusive flock on `fd`, trying until `timeout_s` has passed; whether it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(MAP_LOCK_POLL_S)


def _locked_message(lock_path: pathlib.Path) -> str:
    holders = flock_holders(lock_path)
    who = f"process {', '.join(map(str, holders))}" if holders else "another process"
    return (
        f"the cluster map's lock ({lock_path}) has been held by {who} for over {MAP_LOCK_WAIT_S:g} s; "
        "a process stopped while changing the map holds it until it goes on or exits"
    )


def flock_holders(path: pathlib.Path) -> list[int]:
    """The processes holding a flock on `path`, from /proc/locks ([] where it cannot tell)."""
    try:
        found = os.stat(path)
        table = pathlib.Path("/proc/locks").read_text()
    except OSError:
        return []
    # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:9978290 0 EOF"; waiters' lines have "->".
    wanted = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    holders = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
            holders.append(int(fields[4]))
    return holders
