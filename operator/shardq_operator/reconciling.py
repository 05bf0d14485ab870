"""One ShardqCluster brought to what its resources say, and its shards kept led.

Level-triggered: every call reads the cluster, its Queues, the map in force, the pods
and the leases, and converges (the same call for a timer tick, a Queue change and a
restart of the operator). Writes are idempotent (server-side apply) or compare-and-swap
(leases), so two operators, or one restarted mid-way, cannot corrupt anything: the
loser's lease write fails and it reads again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from shardq.coordination.cluster_map import ClusterMap, cluster_map_from_text, lease_name, new_shards
from shardq.coordination.fencing import build_isr_change, build_takeover, is_expired, isr_of
from shardq.coordination.leases import LeaseConflict, LeaseRecord
from shardq.coordination.new_shard_leases import write_lease_for_new_shard
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.coordination.placement import ShardId
from shardq.coordination.replica_moves import DEFAULT_MAX_IN_FLIGHT, MovePlan, ReplicaMove, plan_replica_moves
from shardq.coordination.takeovers import (
    ServerObservation,
    Takeover,
    TakeoverReason,
    Waiting,
    choose_failovers,
    choose_rebalancing,
    choose_replica_rebalancing,
    isr_after_takeover,
)
from shardq.durations import parse_duration_ms
from shardq_operator import builders, metrics, naming
from shardq_operator.client_authentication import (
    DelegationStep,
    choose_delegation_step,
    client_authentication,
    servers_authenticating,
)
from shardq_operator.kube import ApplyRefused, Kube, Manifest
from shardq_operator.mapping import DesiredMap, desired_map, servers_needed, with_servers
from shardq_operator.observing import NotReady, observe_servers, pod_address, servers_not_ready
from shardq_operator.peer_secrets import cluster_peer_secret
from shardq_operator.server_reads import ServerReads, client_tls_of
from shardq_operator.statuses import LeaderReport
from shardq_operator.transport_security import (
    CallTls,
    ServerTrust,
    TlsSecretProblem,
    call_tls_of,
    check_tls_secret,
    serving_tls_secret,
    tls_secret_name,
)

log = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 10_000
COUNTS_EVERY_S = 5.0
REBALANCE_EVERY_S = 5.0
REAPPLY_S = 60.0


def _split(lease: str) -> tuple[str, int]:
    queue, _, index = lease.rpartition(".")
    return queue, int(index)


def _reported(report: LeaderReport) -> dict[str, Any]:
    """A Shard's status fields from its leader's report."""
    return {"commitIndex": report.commit_index, "load": round(report.load, 1), "depth": report.messages}


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _now_text() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(previous: list[Mapping[str, Any]], kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    """A status condition; lastTransitionTime moves only when the status does."""
    text = "True" if status else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    since = before.get("lastTransitionTime") if before is not None and before.get("status") == text else None
    return {
        "type": kind,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or _now_text(),
    }


def _applied_key(manifest: Manifest) -> tuple[str, str, str]:
    """Kind, namespace ("" for a cluster-scoped object) and name."""
    metadata = manifest["metadata"]
    return (manifest["kind"], metadata.get("namespace", ""), metadata["name"])


def _version(resource: Mapping[str, Any]) -> tuple[str, int]:
    """Which object, in which version of its spec: its uid and generation."""
    metadata = resource.get("metadata", {})
    return (str(metadata.get("uid", "")), int(metadata.get("generation", 0)))


def is_deleting(resource: Mapping[str, Any]) -> bool:
    return bool(resource.get("metadata", {}).get("deletionTimestamp"))


def cluster_of(queue: Mapping[str, Any]) -> str:
    return str(queue.get("spec", {}).get("cluster") or naming.DEFAULT_CLUSTER)


@dataclasses.dataclass
class Tick:
    """What one reconcile saw and did (returned for logs and tests)."""

    cluster_map: ClusterMap | None = None
    takeovers: list[Takeover] = dataclasses.field(default_factory=list)
    problems: dict[str, str] = dataclasses.field(default_factory=dict)
    moves: MovePlan | None = None


# How many servers not ready the Ready condition names (the rest are counted).
NAMED_NOT_READY = 3


def _servers_ready(
    previous: list[Mapping[str, Any]], *, ready_count: int, total: int, troubles: Mapping[str, NotReady]
) -> dict[str, Any]:
    """The cluster's Ready condition: how many servers are ready and, for those that are
    not, why, the ones that will not get there by themselves first (an unbound volume,
    a crash loop, an image that cannot be pulled)."""
    if not troubles:
        return condition(previous, "Ready", True, "AllServersReady", f"{ready_count} of {total} servers ready")
    order = {"unschedulable": 0, "failing": 1, "starting": 2}
    named = sorted(troubles.items(), key=lambda item: (order.get(item[1].kind, 3), item[0]))
    kind = named[0][1].kind
    reason = {"unschedulable": "ServersUnschedulable", "failing": "ServersFailing"}.get(kind, "ServersStarting")
    details = "; ".join(f"{server}: {why.detail}" for server, why in named[:NAMED_NOT_READY])
    more = f" (and {len(named) - NAMED_NOT_READY} more)" if len(named) > NAMED_NOT_READY else ""
    return condition(previous, "Ready", False, reason, f"{ready_count} of {total} servers ready; {details}{more}")


def _tls_condition(previous: list[Mapping[str, Any]], secret: str, problem: TlsSecretProblem | None) -> dict[str, Any]:
    """The TlsReady condition of a cluster with spec.tls: whether its Secret can serve."""
    if problem is not None:
        return condition(previous, "TlsReady", False, "TlsSecretNotUsable", problem.message)
    return condition(
        previous, "TlsReady", True, "TlsSecretUsable", f"the servers serve TLS with the certificate of Secret {secret}"
    )


def missing_dead_letter_queue(cluster_map: ClusterMap, queue: str) -> str:
    """Why `queue`'s dead letters have nowhere to go ("" when they do): its spec names a
    dead-letter queue that is not a Queue of the cluster (a typo, or not made yet)."""
    entry = next((q for q in cluster_map.queues if q.name == queue), None)
    config = entry.config if entry is not None else None
    if config is None or not config.dead_letter_queue or config.dead_letter_queue in cluster_map.placement:
        return ""
    return (
        f"its dead-letter queue {config.dead_letter_queue!r} is not a Queue of this cluster: messages received "
        f"{config.max_receive_count} times are no longer delivered, and wait here until it is made"
    )


def _degraded(previous: list[Mapping[str, Any]], problem: str, placed: bool, dead_letters_stuck: str) -> dict[str, Any]:
    """The Queue's Degraded condition: a spec change the servers cannot apply (on a queue
    that runs; one never placed is Invalid in Ready), and dead letters with nowhere to go."""
    problems = [text for text in (problem, dead_letters_stuck) if text]
    if problem:
        reason = "SpecNotApplied"
    elif dead_letters_stuck:
        reason = "DeadLetterQueueMissing"
    else:
        reason = "AsSpecified"
    degraded = bool(problem and placed) or bool(dead_letters_stuck)
    return condition(previous, "Degraded", degraded, reason, "; ".join(problems) or "the queue runs as specified")


class Reconciler:
    def __init__(self, kube: Kube, *, peer_key: PeerCredential = NO_PEER_SECRET) -> None:
        """`peer_key`: what every cluster's peer secret is derived from (peer_secrets); with
        none, clusters run without one and their servers take any caller for a peer."""
        self.kube = kube
        self.peer_key = peer_key
        # Leader reports and queue counts, read from the servers on a thread of its own.
        self.server_reads = ServerReads(every_s=COUNTS_EVERY_S)
        # (namespace, server) -> monotonic time it was first seen down; its container's start.
        self._down_since: dict[tuple[str, str], float] = {}
        self._started: dict[tuple[str, str], int] = {}
        # Rebalancing: when each cluster was last looked at, its recent moves, its proposals.
        self._rebalanced_at: dict[tuple[str, str], float] = {}
        self._moves: dict[tuple[str, str], list[float]] = {}
        self._proposed: dict[tuple[str, str], list[str]] = {}
        # Replica moves rebalancing asked for, carried out by the next reconcile's plan.
        self._requested: dict[tuple[str, str], list[ReplicaMove]] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_lock = threading.Lock()
        # What was last applied per object, and when (see _apply).
        self._applied: dict[tuple[str, str, str], tuple[str, float]] = {}
        # Last status written per object, so an unchanged status costs no request.
        self._written: dict[tuple[str, str, str], Any] = {}
        # Shards announced as waiting for a safe failover candidate, per cluster, and why.
        self._waiting_said: dict[tuple[str, str], dict[str, TakeoverReason]] = {}
        # Per cluster: why its TLS Secret cannot serve, as announced.
        self._tls_problem_said: dict[tuple[str, str], str] = {}
        # Per cluster: the objects the API server last refused to apply, as announced.
        self._refused_said: dict[tuple[str, str], str] = {}
        # Per cluster: the uid and generation it had when its ClusterRoleBinding to
        # system:auth-delegator was last seen gone. Looked for again only once the spec
        # changes: not a read a second per cluster that never authenticates clients, and
        # still a look after another operator replica may have made one meanwhile.
        self._delegation_gone: dict[tuple[str, str], tuple[str, int]] = {}
        # Per cluster: when the API server last refused that look or deletion. Tried again
        # only after REAPPLY_S: an operator not given the rights (rbac.create=false, rights
        # not granted) would otherwise fail every pass of every cluster, which may not even
        # authenticate clients, and its not-reconciling alert would fire.
        self._delegation_refused_at: dict[tuple[str, str], float] = {}

    def _apply(self, manifest: Manifest) -> None:
        """Apply `manifest` when it differs from what this operator last applied, and every
        object again every REAPPLY_S (undoing hand edits and recreating deleted objects):
        a reconcile runs every second, and applying a dozen unchanged objects each time
        would be a steady stream of writes to the API server."""
        key = _applied_key(manifest)
        text = json.dumps(manifest, sort_keys=True)
        applied = self._applied.get(key)
        if applied is not None and applied[0] == text and time.monotonic() - applied[1] < REAPPLY_S:
            return
        self.kube.apply(manifest)
        self._applied[key] = (text, time.monotonic())

    def _try_apply(self, manifest: Manifest) -> str:
        """`_apply`, or what the API server said refusing it ("" when applied)."""
        try:
            self._apply(manifest)
        except ApplyRefused as refusal:
            return str(refusal)
        return ""

    def _say_refused(self, owner: Manifest, refused: list[str]) -> None:
        """Log, count and announce (once until it changes) objects the API server refused."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        message = "; ".join(refused)
        if not refused:
            self._refused_said.pop((namespace, name), None)
            return
        metrics.RECONCILE_ERRORS.labels(f"{namespace}/{name}").inc()
        if self._refused_said.get((namespace, name)) == message:
            return
        self._refused_said[(namespace, name)] = message
        log.error("cluster %s/%s: the API server refused %s", namespace, name, message)
        try:
            self.kube.event(owner, reason="ApplyRefused", message=message[:1000], warning=True)
        except Exception:  # an event is a courtesy; the failover went on
            log.exception("cluster %s/%s: could not post the ApplyRefused event", namespace, name)

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str) -> Tick:
        label = f"{namespace}/{name}"
        with self._lock(namespace, name):
            metrics.export_cluster(label)
            metrics.RECONCILES.labels(label).inc()
            try:
                return self._reconcile(namespace, name)
            except Exception:
                metrics.RECONCILE_ERRORS.labels(label).inc()
                raise

    def _reconcile(self, namespace: str, name: str) -> Tick:
        owner = self.kube.get_custom("shardqclusters", namespace, name)
        if owner is None:
            self.server_reads.forget((namespace, name))
            return Tick()
        # A cluster being deleted is still reconciled: its deletion waits (finalizer)
        # until its Queues are gone, and their removal from the map is what lets them go.
        spec = owner.get("spec", {})
        queues = [q for q in self.kube.list_custom("queues", namespace) if cluster_of(q) == name]
        live = {q["metadata"]["name"]: q for q in queues if not is_deleting(q)}
        text = self.kube.read_map_text(namespace, name)
        current = cluster_map_from_text(text) if text else None
        try:
            lease_ms = parse_duration_ms(str(spec.get("leaseDuration", "10s")))
        except ValueError:
            lease_ms = DEFAULT_LEASE_MS
        spec_servers = int(spec.get("servers", 3))
        desired = desired_map(
            cluster=name,
            namespace=namespace,
            servers=spec_servers,
            lease_duration_ms=lease_ms,
            queues={queue_name: queue.get("spec", {}) for queue_name, queue in live.items()},
            uids={queue_name: str(queue["metadata"].get("uid", "")) for queue_name, queue in live.items()},
            current=current,
        )
        leases = self.kube.leases(namespace)
        pods = self.kube.server_pods(namespace, name)
        held = {record.name: record for record in leases.list("")}
        # Replicas onto new servers after a scale-out, off the ones that go before a scale-in.
        ready = {server for server, seen in observe_servers(desired.cluster_map.servers, pods).items() if seen.ready}
        moves = plan_replica_moves(
            cluster=desired.cluster_map,
            servers=naming.server_ids(name, spec_servers),
            ready=ready,
            leases=held,
            max_in_flight=int(spec.get("rebalance", {}).get("maxReplicaMovesInFlight", DEFAULT_MAX_IN_FLIGHT)),
            requested=self._requested.pop((namespace, name), []),
        )
        count = servers_needed(name, spec_servers, moves.cluster_map.placement)
        cluster_map = with_servers(moves.cluster_map, name=name, namespace=namespace, count=count)
        # Leases first: a server that sees a new shard in the map finds its lease.
        for shard in new_shards(current, cluster_map):
            record = write_lease_for_new_shard(
                leases,
                shard=shard,
                replicas=cluster_map.replicas_of(shard),
                now_ms=wall_clock_ms,
                duration_ms=cluster_map.lease_duration_ms,
                queue_uid=cluster_map.queue_uid(shard.queue),
            )
            # Owned by the cluster, not the Queue: a Queue created again under the same name
            # must continue its shards' epochs (receipts of the old queue never match), and
            # the Leases go when the cluster does.
            self.kube.own_lease(namespace, record.name, builders.lease_owner_reference(owner))
        self._carry_out_moves(owner, live, moves, cluster_map, held)
        credential = self.credential_of(owner)
        trusts = self._read_tls_secrets(owner, pods)
        tls_secret = tls_secret_name(owner)
        found = trusts.get(tls_secret) if tls_secret is not None else None
        tls_problem = found if isinstance(found, TlsSecretProblem) else None
        self._say_tls_problem(owner, tls_problem)
        delegation = choose_delegation_step(
            client_authentication(owner),
            cluster_deleting=is_deleting(owner),
            authenticating=servers_authenticating(pods),
        )
        manifests = [
            # Before the servers: a pod whose Secret volume is missing does not start.
            *([builders.peer_secret(owner, credential)] if credential.secret is not None else []),
            builders.service_account(owner),
            builders.role(owner),
            builders.role_binding(owner),
            # Before the servers: one authenticating clients without it would refuse them all.
            *([builders.auth_delegator_binding(owner)] if delegation is DelegationStep.APPLY else []),
            builders.map_config(owner, cluster_map),
            builders.peers_service(owner),
            builders.client_service(owner),
            builders.disruption_budget(owner),
            # Not rolled to pods that could not start (their Secret missing or short of a
            # key): the servers there keep serving as they are, until the Secret is right.
            *(
                [
                    builders.stateful_set(
                        owner,
                        servers=count,
                        credential=credential,
                        tls_trust=found if isinstance(found, ServerTrust) else None,
                    )
                ]
                if tls_problem is None
                else []
            ),
        ]
        for queue_name, queue in live.items():
            for index, replicas in enumerate(cluster_map.placement.get(queue_name, [])):
                manifests.append(builders.shard(queue, index=index, replicas=replicas))
        # An object the API server refuses (a hand-edited StatefulSet, a webhook, a quota)
        # is reported, and the pass goes on: failover must not wait on it. It raised here,
        # and kopf's timer then waited a minute before the next pass, while shards whose
        # leader had died stayed unled.
        refused = [problem for manifest in manifests if (problem := self._try_apply(manifest))]
        if delegation is DelegationStep.APPLY:
            self._delegation_gone.pop((namespace, name), None)
        elif (
            delegation is DelegationStep.REMOVE
            and self._delegation_gone.get((namespace, name)) != _version(owner)
            and time.monotonic() - self._delegation_refused_at.get((namespace, name), -REAPPLY_S) >= REAPPLY_S
        ):
            try:
                self._remove_auth_delegation(owner)
            except ApplyRefused as refusal:
                self._delegation_refused_at[(namespace, name)] = time.monotonic()
                refused.append(str(refusal))
        self._say_refused(owner, refused)
        if current is None or current != cluster_map:
            log.info("cluster %s/%s: map now has queues %s", namespace, name, sorted(cluster_map.placement))

        servers = observe_servers(cluster_map.servers, pods)
        calls = self._call_tls(owner, pods, trusts)
        # A pod whose TLS Secret cannot be read is not asked: it could not be checked.
        reachable = {
            address: calls.get(pod["metadata"]["name"])
            for pod in pods
            if is_ready(pod) and (address := pod_address(pod, naming.GRPC_PORT))
            if not isinstance(calls.get(pod["metadata"]["name"]), TlsSecretProblem)
        }
        self.server_reads.want(
            (namespace, name),
            addresses=list(reachable),
            queues=sorted(queue for queue in live if queue in cluster_map.placement),
            credential=credential,
            tls={address: client_tls_of(call) for address, call in reachable.items() if isinstance(call, CallTls)},
        )
        tick = Tick(cluster_map=cluster_map, problems=desired.problems, moves=moves)
        now = wall_clock_ms()
        self._note_down_servers(namespace, servers)
        decisions = choose_failovers(cluster=cluster_map, leases=held, servers=servers, now_ms=now)
        self._say_why_shards_wait(namespace, name, live, [d for d in decisions if isinstance(d, Waiting)], servers)
        for decision in decisions:
            if not isinstance(decision, Takeover):
                continue
            taken = build_takeover(
                decision.lease, new_holder=decision.new_holder, now_ms=now, duration_ms=cluster_map.lease_duration_ms
            )
            try:
                written = leases.update(build_isr_change(taken, isr_after_takeover(decision)))
            except LeaseConflict:
                continue  # someone wrote it since it was read: next tick decides again
            held[written.name] = written
            tick.takeovers.append(decision)
            label = f"{namespace}/{name}"
            metrics.TAKEOVERS.labels(label, decision.reason.value).inc()
            down_since = self._down_since.get((namespace, decision.lease.holder))
            if down_since is not None and decision.reason is not TakeoverReason.REBALANCE:
                metrics.FAILOVER_SECONDS.labels(label).observe(time.monotonic() - down_since)
            message = (
                f"{decision.lease.name}: leadership {decision.lease.holder or 'nobody'} -> {decision.new_holder} "
                f"at epoch {written.transitions} ({decision.reason.value})"
            )
            log.info("cluster %s/%s: %s", namespace, name, message)
            self._event_on_queue(live, decision.lease, reason="Failover", message=message)
        if not tick.takeovers:
            self._rebalance(owner, live, cluster_map, servers, held, tick, replicas_settled=moves.settled)
        troubles = servers_not_ready(servers, pods)
        self._write_statuses(
            owner, live, cluster_map, desired, moves, spec_servers, servers, troubles, held, now, tls_problem
        )
        return tick

    def _read_tls_secrets(
        self, owner: Mapping[str, Any], pods: list[Manifest]
    ) -> dict[str, ServerTrust | TlsSecretProblem]:
        """The TLS Secrets of the cluster (its spec's, and those its pods serve from while
        the StatefulSet rolls from one to another), each read and checked."""
        namespace = owner["metadata"]["namespace"]
        names = {name for pod in pods if (name := serving_tls_secret(pod)) is not None}
        if (named := tls_secret_name(owner)) is not None:
            names.add(named)
        trusts: dict[str, ServerTrust | TlsSecretProblem] = {}
        for name in sorted(names):
            try:
                trusts[name] = check_tls_secret(name, namespace, self.kube.read_secret_data(namespace, name))
            except ApplyRefused as refusal:
                trusts[name] = TlsSecretProblem(f"the operator cannot read it: {refusal}")
        return trusts

    def _call_tls(
        self,
        owner: Mapping[str, Any],
        pods: list[Manifest],
        trusts: Mapping[str, ServerTrust | TlsSecretProblem],
    ) -> dict[str, CallTls | TlsSecretProblem | None]:
        """How the operator's own calls reach each pod's server (by pod name): plaintext
        (None), TLS (CallTls) or not at all (why)."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        return {pod["metadata"]["name"]: call_tls_of(pod, trusts, cluster=name, namespace=namespace) for pod in pods}

    def call_tls_of_servers(
        self, owner: Mapping[str, Any], pods: list[Manifest]
    ) -> dict[str, CallTls | TlsSecretProblem | None]:
        """`_call_tls` with the cluster's Secrets read now: for the calls made outside a
        reconcile (a deleted Queue's finalizer asking the servers), as `credential_of` is."""
        return self._call_tls(owner, pods, self._read_tls_secrets(owner, pods))

    def _say_tls_problem(self, owner: Manifest, problem: TlsSecretProblem | None) -> None:
        """Log and announce (once until it changes) that the cluster's TLS Secret cannot serve."""
        key = (owner["metadata"]["namespace"], owner["metadata"]["name"])
        if problem is None:
            self._tls_problem_said.pop(key, None)
            return
        if self._tls_problem_said.get(key) == problem.message:
            return
        self._tls_problem_said[key] = problem.message
        message = f"{problem.message}; the server pods are left as they are until it can"
        log.error("cluster %s/%s: %s", *key, message)
        try:
            self.kube.event(owner, reason="TlsSecretNotUsable", message=message, warning=True)
        except Exception:  # an event is a courtesy; the status says it too
            log.exception("cluster %s/%s: could not post the TlsSecretNotUsable event", *key)

    def credential_of(self, owner: Mapping[str, Any]) -> PeerCredential:
        """The cluster's peer secret (derived from the operator's key; peer_secrets): what
        its servers present to each other, and what the operator's own calls to them
        carry, taken in place of a client's token."""
        metadata = owner["metadata"]
        return cluster_peer_secret(
            self.peer_key, namespace=metadata["namespace"], cluster=metadata["name"], uid=str(metadata.get("uid", ""))
        )

    def release(self, owner: Mapping[str, Any]) -> None:
        """Remove what a ShardqCluster being deleted (`owner`) leaves behind that no owner
        reference takes away: its servers' ClusterRoleBinding to system:auth-delegator.
        Idempotent (none, or one already gone, is fine); ApplyRefused when the API server
        refuses. Under the cluster's lock: a pass that began before the deletion, and so
        may still apply the binding, ends first."""
        with self._lock(owner["metadata"]["namespace"], owner["metadata"]["name"]):
            self._remove_auth_delegation(owner)

    def _remove_auth_delegation(self, owner: Mapping[str, Any]) -> None:
        """Delete the cluster's ClusterRoleBinding to system:auth-delegator if it has one."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        binding = naming.auth_delegator_binding(namespace, name)
        if self.kube.delete_cluster_role_binding(binding, labels=naming.cluster_scoped_labels(namespace, name)):
            log.info("cluster %s/%s: deleted ClusterRoleBinding %s", namespace, name, binding)
        self._delegation_gone[(namespace, name)] = _version(owner)
        self._delegation_refused_at.pop((namespace, name), None)
        # Applied anew at once if the cluster authenticates its clients again.
        self._applied.pop(("ClusterRoleBinding", "", binding), None)

    def _say_why_shards_wait(
        self,
        namespace: str,
        name: str,
        live: Mapping[str, Manifest],
        waiting: list[Waiting],
        servers: Mapping[str, ServerObservation],
    ) -> None:
        """Log and announce (once per shard and reason) a shard that needs a new leader and
        has no in-sync replica on a ready server: the operator then promotes nobody, which
        keeps every acknowledged write but leaves the shard unled, and whoever looks at it
        must see why without reading the code."""
        key = (namespace, name)
        said = self._waiting_said.setdefault(key, {})
        pending = {decision.lease.name for decision in waiting}
        for lease in [lease for lease in said if lease not in pending]:
            del said[lease]
        for decision in waiting:
            if said.get(decision.lease.name) == decision.reason:
                continue
            said[decision.lease.name] = decision.reason
            ready = sorted(server for server, seen in servers.items() if seen.ready)
            message = (
                f"{decision.lease.name} needs a new leader ({decision.reason.value}: "
                f"{decision.lease.holder or 'nobody'}) but none of its in-sync replicas "
                f"{sorted(isr_of(decision.lease))} is on a ready server (ready: {ready}); waiting"
            )
            log.warning("cluster %s/%s: %s", namespace, name, message)
            self._event_on_queue(live, decision.lease, reason="FailoverWaiting", message=message, warning=True)

    def _carry_out_moves(
        self,
        owner: Manifest,
        live: Mapping[str, Manifest],
        moves: MovePlan,
        cluster_map: ClusterMap,
        held: dict[str, LeaseRecord],
    ) -> None:
        """Hand leadership off replicas that are leaving (lease CAS), count and announce
        the moves the new map starts and finishes."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        label = f"{namespace}/{name}"
        now = wall_clock_ms()
        for handoff in moves.handoffs:
            taken = build_takeover(
                handoff.lease, new_holder=handoff.new_holder, now_ms=now, duration_ms=cluster_map.lease_duration_ms
            )
            try:
                written = self.kube.leases(namespace).update(build_isr_change(taken, isr_after_takeover(handoff)))
            except LeaseConflict:
                continue  # renewed or taken since it was read: the next pass decides again
            held[written.name] = written
            metrics.TAKEOVERS.labels(label, handoff.reason.value).inc()
            message = (
                f"{handoff.lease.name}: leadership {handoff.lease.holder} -> {handoff.new_holder} at epoch "
                f"{written.transitions}, before its replica on {handoff.lease.holder} moves"
            )
            log.info("cluster %s: %s", label, message)
            self._event_on_queue(live, handoff.lease, reason="LeadershipHandedOff", message=message)
        for move, verb in [*((m, "started") for m in moves.started), *((m, "finished") for m in moves.finished)]:
            metrics.REPLICA_MOVES.labels(label, verb).inc()
            shard = lease_name(move.shard)
            message = (
                f"{shard}: copying a replica to {move.target}"
                if verb == "started"
                else f"{shard}: replica on {move.source} removed, {move.target} in sync"
            )
            log.info("cluster %s: replica move %s: %s", label, verb, message)
            if shard in held:
                reason = "ReplicaMoveStarted" if verb == "started" else "ReplicaMoveFinished"
                self._event_on_queue(live, held[shard], reason=reason, message=message)

    def _rebalance(
        self,
        owner: Manifest,
        live: Mapping[str, Manifest],
        cluster_map: ClusterMap,
        servers: Mapping[str, ServerObservation],
        held: dict[str, LeaseRecord],
        tick: Tick,
        *,
        replicas_settled: bool,
    ) -> None:
        """Move leadership of hot shards off a hot server (spec.rebalance), throttled, or,
        when that cannot help, a replica of one to a cooler server (one at a time, while no
        other replica moves); in `propose` mode only say so in the cluster's status."""
        namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
        key = (namespace, name)
        settings = owner.get("spec", {}).get("rebalance", {})
        mode = settings.get("mode", "auto")
        if mode == "off" or time.monotonic() - self._rebalanced_at.get(key, 0.0) < REBALANCE_EVERY_S:
            return
        self._rebalanced_at[key] = time.monotonic()
        recent = [at for at in self._moves.get(key, []) if time.monotonic() - at < 60]
        self._moves[key] = recent
        allowed = int(settings.get("maxMovesPerMinute", 6)) - len(recent)
        if allowed <= 0:
            return
        loads = {shard: report.load for shard, report in self.server_reads.leader_reports((namespace, name)).items()}
        now = wall_clock_ms()
        # The spec gives a factor over the mean; the planner wants the excess over it.
        threshold = max(float(settings.get("imbalanceThreshold", 1.5)) - 1.0, 0.0)
        moves = choose_rebalancing(
            cluster=cluster_map,
            leases=held,
            servers=servers,
            shard_loads=loads,
            now_ms=now,
            max_moves=min(allowed, 1),
            imbalance_threshold=threshold,
        )
        described = [
            f"{move.lease.name}: {move.lease.holder} -> {move.new_holder} "
            f"({loads.get(ShardId(*_split(move.lease.name)), 0.0):.0f} requests/s)"
            for move in moves
        ]
        replica_move = None
        if not moves and replicas_settled:
            # Leadership alone cannot cool the hottest server: a replica of one of its hot
            # shards goes to a cooler server first (then leadership follows it).
            replica_move = choose_replica_rebalancing(
                cluster=cluster_map,
                leases=held,
                servers=servers,
                shard_loads=loads,
                now_ms=now,
                imbalance_threshold=threshold,
            )
        if replica_move is not None:
            described.append(
                f"{lease_name(replica_move.shard)}: a replica to {replica_move.to_server}, off hot "
                f"{replica_move.from_server} ({loads.get(replica_move.shard, 0.0):.0f} requests/s)"
            )
        self._proposed[key] = described if mode == "propose" else []
        if mode != "auto":
            return
        if replica_move is not None:
            self._requested[key] = [
                ReplicaMove(shard=replica_move.shard, source=replica_move.from_server, target=replica_move.to_server)
            ]
            self._moves[key].append(time.monotonic())
            log.info("cluster %s/%s: rebalance %s", namespace, name, described[-1])
        for move, text in zip(moves, described, strict=True):
            taken = build_takeover(
                move.lease, new_holder=move.new_holder, now_ms=now, duration_ms=cluster_map.lease_duration_ms
            )
            try:
                written = self.kube.leases(namespace).update(build_isr_change(taken, isr_after_takeover(move)))
            except LeaseConflict:
                continue
            held[written.name] = written
            tick.takeovers.append(move)
            self._moves[key].append(time.monotonic())
            metrics.TAKEOVERS.labels(f"{namespace}/{name}", move.reason.value).inc()
            log.info("cluster %s/%s: rebalance %s", namespace, name, text)
            self._event_on_queue(
                live, move.lease, reason="Rebalance", message=f"leadership moved off a hot server: {text}"
            )

    def _note_down_servers(self, namespace: str, servers: Mapping[str, ServerObservation]) -> None:
        """When each server was first seen not running (or restarted), for failover timing."""
        for name, server in servers.items():
            key = (namespace, name)
            started = self._started.get(key)
            if not server.running or (started is not None and server.started_at_ms != started):
                self._down_since.setdefault(key, time.monotonic())
            else:
                self._down_since.pop(key, None)
            if server.running:
                self._started[key] = server.started_at_ms

    def _event_on_queue(
        self, live: Mapping[str, Manifest], lease: LeaseRecord, *, reason: str, message: str, warning: bool = False
    ) -> None:
        queue_name, index = _split(lease.name)
        queue = live.get(queue_name)
        if queue is None:
            return
        shard = builders.shard(queue, index=index, replicas=[])
        shard["metadata"]["namespace"] = queue["metadata"]["namespace"]
        for involved in (queue, shard):
            try:
                self.kube.event(involved, reason=reason, message=message, warning=warning)
            except Exception:  # an event is a courtesy; the decision is made
                log.warning("could not post event %s on %s", reason, lease.name, exc_info=True)

    def _status(self, plural: str, resource: Manifest, status: dict[str, Any]) -> None:
        metadata = resource["metadata"]
        key = (plural, metadata["namespace"], metadata["name"])
        comparable = {k: v for k, v in status.items() if k != "conditions"}
        comparable["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions", [])
        ]
        if self._written.get(key) == comparable and resource.get("status", {}).get("observedGeneration") == status.get(
            "observedGeneration"
        ):
            return
        self.kube.patch_status(plural, metadata["namespace"], metadata["name"], status)
        self._written[key] = comparable

    def _write_statuses(
        self,
        owner: Manifest,
        live: Mapping[str, Manifest],
        cluster_map: ClusterMap,
        desired: DesiredMap,
        moves: MovePlan,
        spec_servers: int,
        servers: Mapping[str, ServerObservation],
        troubles: Mapping[str, NotReady],
        held: Mapping[str, LeaseRecord],
        now: int,
        tls_problem: TlsSecretProblem | None = None,
    ) -> None:
        namespace = owner["metadata"]["namespace"]
        cluster = owner["metadata"]["name"]
        reports = self.server_reads.leader_reports((namespace, cluster))
        ready = sorted(name for name, server in servers.items() if server.ready)
        leads = dict.fromkeys(servers, 0)
        led_load = dict.fromkeys(servers, 0.0)
        serving: dict[str, bool] = {}
        for shard in cluster_map.shards():
            lease = held.get(lease_name(shard))
            ok = lease is not None and lease.holder in ready and not is_expired(lease, now)
            serving[lease_name(shard)] = ok
            if lease is not None and lease.holder in leads:
                leads[lease.holder] += 1
                led_load[lease.holder] += reports[shard].load if shard in reports else 0.0
        previous = owner.get("status", {}).get("conditions", [])
        moving = [f"{shard}: {why}" for shard, why in sorted(moves.waiting.items())]
        scaling = (
            f"scaling in to {spec_servers} servers: moving replicas off {', '.join(moves.draining)} first"
            if moves.draining
            else ""
        )
        stuck = [f"{shard}: {why}" for shard, why in sorted(moves.stuck.items())]
        if scaling and stuck:  # why it does not finish, not only that it goes on
            scaling += f"; {'; '.join(stuck[:3])}" + (f" (and {len(stuck) - 3} more)" if len(stuck) > 3 else "")
        conditions = [
            _servers_ready(previous, ready_count=len(ready), total=len(servers), troubles=troubles),
            condition(
                previous,
                "Progressing",
                bool(moving or moves.draining),
                "MovingReplicas" if moving or moves.draining else "Settled",
                scaling or (f"{len(moving)} shards moving a replica" if moving else "every replica where it belongs"),
            ),
        ]
        if (tls_secret := tls_secret_name(owner)) is not None:
            conditions.append(_tls_condition(previous, tls_secret, tls_problem))
            if tls_problem is not None and conditions[0]["status"] == "False":
                # What keeps the servers from starting comes first (`kubectl get sqc` shows the reason).
                conditions[0] = condition(
                    previous,
                    "Ready",
                    False,
                    "TlsSecretNotUsable",
                    f"{tls_problem.message}; {conditions[0]['message']}",
                )
        self._status(
            "shardqclusters",
            owner,
            {
                "observedGeneration": owner["metadata"].get("generation", 0),
                "readyServers": len(ready),
                "queues": len(cluster_map.placement),
                "proposedMoves": self._proposed.get((namespace, cluster), []),
                "replicaMoves": moving,
                "servers": [
                    {"name": name, "ready": servers[name].ready, "leads": leads[name], "load": round(led_load[name], 1)}
                    for name in sorted(servers)
                ],
                "conditions": conditions,
            },
        )
        for queue_name, queue in live.items():
            problem = desired.problems.get(queue_name, "")
            shards: list[dict[str, Any]] = []
            for index, replicas in enumerate(cluster_map.placement.get(queue_name, [])):
                lease = held.get(lease_name(ShardId(queue_name, index)))
                shards.append(
                    {
                        "index": index,
                        "leader": lease.holder if lease is not None else "",
                        "epoch": lease.transitions if lease is not None else 0,
                        "replicas": replicas,
                    }
                )
            placed = queue_name in cluster_map.placement
            led = placed and all(serving.get(lease_name(ShardId(queue_name, i)), False) for i in range(len(shards)))
            previous = queue.get("status", {}).get("conditions", [])
            if problem and not placed:
                ready_condition = condition(previous, "Ready", False, "Invalid", problem)
            elif not led:
                ready_condition = condition(
                    previous, "Ready", False, "ShardsWithoutLeader", "some shard has no serving leader yet"
                )
            else:
                ready_condition = condition(previous, "Ready", True, "AllShardsLed", f"{len(shards)} shards led")
            short = sorted(
                lease_name(ShardId(queue_name, entry["index"]))
                for entry in shards
                if lease_name(ShardId(queue_name, entry["index"])) in held
                if len(isr_of(held[lease_name(ShardId(queue_name, entry["index"]))])) < len(entry["replicas"])
            )
            queue_conditions = [
                ready_condition,
                condition(
                    previous,
                    "UnderReplicated",
                    bool(short),
                    "ReplicasCatchingUp" if short else "AllReplicasInSync",
                    f"shards with a replica out of sync: {', '.join(short)}" if short else "every replica in sync",
                ),
                _degraded(previous, problem, placed, missing_dead_letter_queue(cluster_map, queue_name)),
            ]
            self._status(
                "queues",
                queue,
                {
                    "observedGeneration": queue["metadata"].get("generation", 0),
                    "phase": "Ready"
                    if ready_condition["status"] == "True"
                    else ("Invalid" if problem and not placed else "Pending"),
                    "endpoint": naming.client_endpoint(cluster, namespace),
                    **(self.server_reads.queue_counts(namespace, queue_name) if placed else {}),
                    "shards": shards,
                    "conditions": queue_conditions,
                },
            )
            for entry in shards:
                shard_lease = lease_name(ShardId(queue_name, entry["index"]))
                lease = held.get(shard_lease)
                report = reports.get(ShardId(queue_name, entry["index"]))
                shard_object = builders.shard(queue, index=entry["index"], replicas=entry["replicas"])
                shard_object["metadata"]["namespace"] = namespace
                isr = sorted(isr_of(lease)) if lease is not None else []
                self._status(
                    "shards",
                    shard_object,
                    {
                        "leader": entry["leader"],
                        "epoch": entry["epoch"],
                        "isr": isr,
                        "isrText": ",".join(isr),
                        **(_reported(report) if report is not None else {}),
                        "conditions": [condition([], "Ready", serving.get(shard_lease, False), "Led", "")],
                    },
                )
