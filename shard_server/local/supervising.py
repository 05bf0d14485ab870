"""The supervisor loop: keep every server running and every shard led, and carry out decisions.

Each tick (a quarter of a second) it reaps exited servers, notes which became ready,
fails over the leases whose holder died or stopped renewing, restarts servers whose
backoff is over, and every few seconds evens out leader load. What to do is decided by
`takeovers` from what was just observed; this module only observes and acts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

from shard_server.local.cluster_files import (
    SupervisedServer,
    SupervisorRecord,
    remove_supervisor_record,
    write_supervisor_record,
)
from shard_server.local.observing import compute_shard_loads, fetch_all_replica_status
from shard_server.local.processes import (
    ManagedServer,
    build_server_command,
    server_log_path,
    stop_servers,
    wall_clock_ms,
)
from shardq.coordination.cluster_map import CLUSTER_FILE, ClusterMap, lease_name, read_cluster_map
from shardq.coordination.fencing import build_isr_change, build_takeover, isr_of
from shardq.coordination.leases import LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.peer_credentials import PeerCredential
from shardq.coordination.takeovers import (
    ServerObservation,
    Takeover,
    TakeoverReason,
    Waiting,
    choose_failovers,
    choose_rebalancing,
    isr_after_takeover,
    lease_for_new_shard,
)

logger = logging.getLogger("shard_server.local")

TICK_S = 0.25
REBALANCE_EVERY_S = 5.0
STOP_DEADLINE_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorSettings:
    data_dir: pathlib.Path
    tick_s: float = TICK_S
    rebalance_every_s: float = REBALANCE_EVERY_S
    stop_deadline_s: float = STOP_DEADLINE_S


def ensure_shard_leases(store: LeaseStore, cluster: ClusterMap, *, now_ms: int) -> list[LeaseRecord]:
    """Create the lease of every shard that has none; returns the leases created.

    Existing leases are kept as they are: they carry the epochs already handed out, and a
    lease from a previous run is taken over in a new epoch by the failover pass, because
    its holder's process is a new one.
    """
    created: list[LeaseRecord] = []
    for shard in cluster.shards():
        if store.get(lease_name(shard)) is not None:
            continue
        lease = lease_for_new_shard(
            None,
            shard=shard,
            replicas=cluster.replicas_of(shard),
            now_ms=now_ms,
            duration_ms=cluster.lease_duration_ms,
            queue_uid=cluster.queue_uid(shard.queue),
        )
        try:
            created.append(store.create(lease))
        except LeaseConflict:
            continue  # created in between by someone else: theirs stands
    return created


def read_shard_leases(store: LeaseStore, cluster: ClusterMap) -> dict[str, LeaseRecord]:
    wanted = {lease_name(shard) for shard in cluster.shards()}
    return {lease.name: lease for lease in store.list("") if lease.name in wanted}


class Supervisor:
    def __init__(
        self, *, settings: SupervisorSettings, cluster: ClusterMap, store: LeaseStore, credential: PeerCredential
    ) -> None:
        """`credential`: the cluster's peer secret (cluster_files.ensure_peer_secret), which
        its servers are started with and its status calls carry."""
        self.settings = settings
        self.cluster = cluster
        self._map_stamp = 0
        self.store = store
        self.credential = credential
        self.servers = {
            server_id: ManagedServer(
                entry=entry,
                command=build_server_command(data_dir=settings.data_dir, server=entry),
                log_path=server_log_path(settings.data_dir, server_id),
            )
            for server_id, entry in sorted(cluster.servers.items())
        }
        self._waiting_logged: dict[str, TakeoverReason] = {}
        self._next_rebalance = time.monotonic() + settings.rebalance_every_s
        self._all_ready_logged = False
        # Leader loads from the last rebalancing round: failover prefers the cooler candidates.
        self._server_loads: dict[str, float] = {}

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] = lambda: None) -> None:
        """Start the cluster and supervise it until `stop` is set; then stop every server it started."""
        try:
            self.start()
            on_started()
            while not stop.wait(self.settings.tick_s):
                self.tick()
        finally:
            stop_servers(list(self.servers.values()), deadline_s=self.settings.stop_deadline_s, report=logger.info)
            remove_supervisor_record(self.settings.data_dir)
            logger.info("all servers stopped")

    def start(self) -> None:
        for server in self.servers.values():
            server.start()
        # After the starts, so a new lease is younger than its holder's process and is not
        # mistaken for one left by an earlier process (see takeovers.holder_incarnation_is_gone).
        created = ensure_shard_leases(self.store, self.cluster, now_ms=wall_clock_ms())
        if created:
            logger.info("created %d shard leases (placement leaders, epoch 1, every replica in sync)", len(created))
        self.write_record()
        self.fail_over()

    def follow_cluster_map(self) -> None:
        """Pick up queues created, deleted or changed at run time (servers write the map)."""
        path = self.settings.data_dir / CLUSTER_FILE
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return
        if stamp == self._map_stamp:
            return
        self._map_stamp = stamp
        try:
            cluster = read_cluster_map(path)
        except ValueError as error:
            logger.error("%s; failovers keep using the map read before", error)
            return
        added = sorted({queue.name for queue in cluster.queues} - {queue.name for queue in self.cluster.queues})
        removed = sorted({queue.name for queue in self.cluster.queues} - {queue.name for queue in cluster.queues})
        if added or removed:
            logger.info("cluster map changed: queues added %s, removed %s", added or "none", removed or "none")
        self.cluster = cluster

    def tick(self) -> None:
        self.follow_cluster_map()
        for server in self.servers.values():
            code = server.check_exited()
            if code is not None:
                logger.warning(
                    "%s (pid %s) exited with code %s; restarting in %.1fs; its last words: %s",
                    server.server_id,
                    server.pid,
                    code,
                    server.seconds_until_restart(),
                    server.last_log_line() or "(none)",
                )
            if server.ready_since_ms is None and server.check_ready():
                logger.info("%s ready on %s (pid %s)", server.server_id, server.entry.address, server.pid)
        self._log_all_ready()
        self.fail_over()
        restarted = False
        for server in self.servers.values():
            if server.restart_is_due():
                server.restarts += 1
                server.start()
                restarted = True
                logger.info("restarted %s (pid %s, restart %d)", server.server_id, server.pid, server.restarts)
        if restarted:
            self.write_record()
            # At once, before the new process could renew a lease its predecessor held:
            # that lease must come back in a new epoch.
            self.fail_over()
        if time.monotonic() >= self._next_rebalance:
            self._next_rebalance = time.monotonic() + self.settings.rebalance_every_s
            self.rebalance()

    def observe_servers(self, loads: dict[str, float] | None = None) -> dict[str, ServerObservation]:
        return {
            server_id: ServerObservation(
                name=server_id,
                running=server.running(),
                started_at_ms=server.started_at_ms,
                ready_since_ms=server.ready_since_ms if server.running() else None,
                load=(loads or {}).get(server_id, 0.0),
            )
            for server_id, server in self.servers.items()
        }

    def fail_over(self) -> None:
        leases = read_shard_leases(self.store, self.cluster)
        decisions = choose_failovers(
            cluster=self.cluster,
            leases=leases,
            servers=self.observe_servers(self._server_loads),
            now_ms=wall_clock_ms(),
        )
        pending = {decision.lease.name for decision in decisions if isinstance(decision, Waiting)}
        for name in list(self._waiting_logged):
            if name not in pending:
                del self._waiting_logged[name]
        for decision in decisions:
            if isinstance(decision, Takeover):
                self.carry_out(decision)
            elif self._waiting_logged.get(decision.lease.name) != decision.reason:
                self._waiting_logged[decision.lease.name] = decision.reason
                logger.warning(
                    "%s needs a new leader (%s: %s) but none of its in-sync replicas %s is ready; waiting",
                    decision.lease.name,
                    decision.reason.value,
                    decision.lease.holder or "nobody",
                    sorted(isr_of(decision.lease)),
                )

    def rebalance(self) -> None:
        ready = {
            server_id: server.entry.address
            for server_id, server in self.servers.items()
            if server.running() and server.ready_since_ms is not None
        }
        reports = fetch_all_replica_status(ready, credential=self.credential)
        leases = read_shard_leases(self.store, self.cluster)
        leaders = {
            shard: leases[lease_name(shard)].holder for shard in self.cluster.shards() if lease_name(shard) in leases
        }
        shard_loads = compute_shard_loads(reports, leaders)
        server_loads: dict[str, float] = {}
        for shard, leader in leaders.items():
            server_loads[leader] = server_loads.get(leader, 0.0) + shard_loads.get(shard, 0.0)
        self._server_loads = server_loads
        moves = choose_rebalancing(
            cluster=self.cluster,
            leases=leases,
            servers=self.observe_servers(server_loads),
            shard_loads=shard_loads,
            now_ms=wall_clock_ms(),
        )
        if moves:
            load_text = ", ".join(f"{name} {load:.0f}/s" for name, load in sorted(server_loads.items()))
            logger.info("leader loads: %s", load_text)
        for move in moves:
            self.carry_out(move)

    def carry_out(self, takeover: Takeover) -> None:
        lease = takeover.lease
        updated = build_takeover(
            lease, new_holder=takeover.new_holder, now_ms=wall_clock_ms(), duration_ms=self.cluster.lease_duration_ms
        )
        updated = build_isr_change(updated, isr_after_takeover(takeover))
        try:
            self.store.update(updated)
        except LeaseConflict:
            # Renewed or changed since it was read: the facts moved, the next tick decides again.
            logger.info("%s changed while deciding (%s); looking again", lease.name, takeover.reason.value)
            return
        logger.warning(
            "%s: leader %s -> %s (%s), epoch %d -> %d",
            lease.name,
            lease.holder or "nobody",
            takeover.new_holder,
            takeover.reason.value,
            lease.transitions,
            updated.transitions,
        )

    def write_record(self) -> None:
        record = SupervisorRecord(
            pid=os.getpid(),
            servers={
                server_id: SupervisedServer(
                    server_id=server_id,
                    pid=server.pid or 0,
                    endpoint=server.entry.address,
                    metrics_endpoint=server.entry.metrics_address,
                    log=str(server.log_path),
                )
                for server_id, server in self.servers.items()
            },
        )
        write_supervisor_record(self.settings.data_dir, record)

    def _log_all_ready(self) -> None:
        if self._all_ready_logged or not all(server.ready_since_ms is not None for server in self.servers.values()):
            return
        self._all_ready_logged = True
        logger.info(
            "all %d servers ready; `shardq local status --data-dir %s`", len(self.servers), self.settings.data_dir
        )
