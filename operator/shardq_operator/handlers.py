"""kopf registrations: what wakes the reconciler up.

Every ShardqCluster is reconciled once a second (a timer: failover decisions need a
steady look at pods and leases), and at once when one of its Queues changes. Deletion
is guarded: a Queue's finalizer waits until the servers have dropped its data, and a
ShardqCluster with Queues on it is not deleted (an Event says why). A ShardqCluster's
finalizer also lets the operator delete what the cluster cannot own: its servers'
ClusterRoleBinding (client authentication).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from shardq import Client, ShardqError
from shardq.coordination.cluster_map import cluster_map_from_text
from shardq.coordination.peer_credentials import PeerCredential
from shardq_operator import naming
from shardq_operator.kube import ApplyRefused, Kube
from shardq_operator.leadership import OperatorLeadership
from shardq_operator.observing import servers_to_ask
from shardq_operator.reconciling import Reconciler, cluster_of
from shardq_operator.server_reads import client_tls_of
from shardq_operator.transport_security import CallTls, TlsSecretProblem

log = logging.getLogger(__name__)

TICK_S = 1.0
# After an error a pass is tried again this soon: kopf's default, a minute, held failover back.
ERROR_BACKOFF_S = 5.0
# A cluster whose deletion waits for its Queues says so once every this many passes.
DELETION_BLOCKED_EVERY = 12
TICK_SUCCEEDED = "Timer 'tick_cluster' succeeded."  # as kopf words it
STANDBY_RETRY_S = 2
STANDBY_MESSAGE = "another operator replica leads; standing by"
_state: dict[str, object] = {}


def use(reconciler: Reconciler, leadership: OperatorLeadership, *, named_namespaces: bool = False) -> None:
    """Set what the handlers use (the operator's entry point does, before kopf runs).

    `named_namespaces`: the operator serves only namespaces named on its command line."""
    _state["reconciler"] = reconciler
    _state["leadership"] = leadership
    _state["named_namespaces"] = named_namespaces


def _reconciler() -> Reconciler:
    reconciler = _state["reconciler"]
    assert isinstance(reconciler, Reconciler)
    return reconciler


def _leading() -> bool:
    leadership = _state["leadership"]
    assert isinstance(leadership, OperatorLeadership)
    return leadership.leading()


def _require_leading() -> None:
    """Handlers that must run once (creation, deletion) wait while another replica leads;
    kopf retries them, and the leader's own run marks them done."""
    if not _leading():
        raise kopf.TemporaryError(STANDBY_MESSAGE, delay=STANDBY_RETRY_S)


class StandbyIsNotAnError(logging.Filter):
    """Drops kopf's "failed temporarily" records of a standby replica's waiting handlers.

    kopf logs every TemporaryError at ERROR and posts it as an Event on the object: a
    healthy standby would fill its log with an error every two seconds per object and
    the Queues' Events with warnings, for waiting as it should. Leadership changes are
    logged by OperatorLeadership instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return STANDBY_MESSAGE not in record.getMessage()


class RoutineTicksAreQuiet(logging.Filter):
    """Drops kopf's "Timer 'tick_cluster' succeeded." record, logged once a second per
    cluster: sixty of them a minute would push what the operator did (failovers, moves,
    shards waiting for a safe leader) out of any `kubectl logs --tail`. A failing tick is
    still logged, by kopf, as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != TICK_SUCCEEDED


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects as our own client does (kubeconfig or the pod's service account),
    client certificates included."""
    configuration = _reconciler().kube.api_client.configuration
    # A kubeconfig's token is kept as `authorization`, a pod's service account token as `BearerToken`.
    token = (configuration.api_key or {}).get("authorization") or (configuration.api_key or {}).get("BearerToken", "")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        scheme="Bearer" if token else None,
        token=token.split(" ", 1)[-1].strip() or None,  # without its "Bearer "/"bearer " prefix
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Our own Events say what happened; kopf's per-handler ones would drown them.
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "shardq.io/operator"
    settings.watching.server_timeout = 60
    if _state.get("named_namespaces"):
        # Serving named namespaces, the operator has no right to list namespaces or CRDs at
        # cluster scope (the chart grants Roles in those namespaces only). Scanning would
        # retry the refused lists for about 40 s before kopf falls back to the names given,
        # and no handler would run meanwhile: a failover after an operator restart waited
        # for it. The names are exact, so there is nothing to scan for.
        settings.scanning.disabled = True


@kopf.timer(naming.GROUP, naming.VERSION, "shardqclusters", interval=TICK_S, backoff=ERROR_BACKOFF_S)
def tick_cluster(namespace: str | None, name: str, **_: Any) -> None:
    assert namespace is not None, "shardq resources are namespaced"
    if not _leading():
        return  # the leading replica reconciles; this one looks again next tick
    _reconciler().reconcile(namespace, name)


@kopf.on.resume(naming.GROUP, naming.VERSION, "queues")
@kopf.on.create(naming.GROUP, naming.VERSION, "queues")
@kopf.on.update(naming.GROUP, naming.VERSION, "queues")
def queue_changed(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
    assert namespace is not None, "shardq resources are namespaced"
    _require_leading()
    cluster = cluster_of(body)
    reconciler = _reconciler()
    if reconciler.kube.get_custom("shardqclusters", namespace, cluster) is None:
        reconciler.kube.patch_status(
            "queues",
            namespace,
            name,
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "False",
                        "reason": "ClusterMissing",
                        "message": f"no ShardqCluster {cluster!r} in namespace {namespace}",
                    }
                ],
            },
        )
        raise kopf.TemporaryError(f"ShardqCluster {cluster!r} does not exist (yet)", delay=5)
    reconciler.reconcile(namespace, cluster)


@kopf.on.delete(naming.GROUP, naming.VERSION, "queues")
def queue_deleted(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
    """Take the queue out of the map, then wait until every server of the cluster, those
    down or starting included, has dropped its data."""
    assert namespace is not None, "shardq resources are namespaced"
    _require_leading()
    reconciler = _reconciler()
    cluster = cluster_of(body)
    owner = reconciler.kube.get_custom("shardqclusters", namespace, cluster)
    if owner is None:
        return  # no servers: nothing holds its data
    tick = reconciler.reconcile(namespace, cluster)
    # The cluster's peer secret: servers that authenticate their clients take it for a token.
    credential = reconciler.credential_of(owner)
    waiting = _servers_holding(reconciler, namespace, cluster, owner, name, credential)
    if waiting:
        message = f"waiting until every server has dropped the queue's data: {waiting}"
        if name in tick.problems:  # kept in the map, as another queue's dead-letter queue
            message = f"{tick.problems[name]}; {message}"
        reconciler.kube.patch_status(
            "queues",
            namespace,
            name,
            {
                "phase": "Deleting",
                "conditions": [{"type": "Ready", "status": "False", "reason": "Deleting", "message": message}],
            },
        )
        raise kopf.TemporaryError(message, delay=1)


def _servers_holding(
    reconciler: Reconciler,
    namespace: str,
    cluster: str,
    owner: kopf.Body | dict[str, Any],
    queue: str,
    credential: PeerCredential,
) -> str:
    """Which servers may still hold `queue`'s data, and why ("" when none): those that
    list it, and those that cannot be asked now (down, starting, without a pod). Every
    server counts: the cluster's servers by its spec and by its map, and any pod of it.
    Servers serving TLS are asked over TLS, checked against their Secret's CA."""
    kube: Kube = reconciler.kube
    text = kube.read_map_text(namespace, cluster)
    mapped = set(cluster_map_from_text(text).servers) if text else set()
    servers = mapped | set(naming.server_ids(cluster, int(owner.get("spec", {}).get("servers", 3))))
    pods = kube.server_pods(namespace, cluster)
    askable, silent = servers_to_ask(servers, pods)
    calls = reconciler.call_tls_of_servers(owner, pods) if askable else {}
    # With the StatefulSet going (a namespace deleted whole), no server comes back to its
    # volume under this cluster: waiting for the silent ones would hold the deletion for good.
    holding = {} if silent and kube.server_set_goes(namespace, cluster) else dict(silent)
    for server, address in askable.items():
        call = calls.get(server)
        if isinstance(call, TlsSecretProblem):
            holding[server] = f"it serves TLS and cannot be checked: {call.message}"
            continue
        tls = client_tls_of(call) if isinstance(call, CallTls) else False
        try:
            with Client(address, route_directly=False, metadata=credential.metadata, tls=tls) as client:
                if queue in client.list_queues():
                    holding[server] = "it still hosts the queue"
        except ShardqError as error:
            holding[server] = f"it did not answer ({error.reason})"
    return "; ".join(f"{server}: {why}" for server, why in sorted(holding.items()))


@kopf.on.delete(naming.GROUP, naming.VERSION, "shardqclusters")
def cluster_deleted(namespace: str | None, name: str, body: kopf.Body, retry: int, **_: Any) -> None:
    """Refuse to go while Queues are placed on the cluster; meanwhile go on reconciling it.
    kopf stops a resource's timers once its deletion starts, so this handler's retries
    are the only passes left: without them a dead leader's shards were never failed over,
    and scaling was not carried out, for as long as the deletion waited."""
    assert namespace is not None, "shardq resources are namespaced"
    _require_leading()
    reconciler = _reconciler()
    kube = reconciler.kube
    queues = sorted(q["metadata"]["name"] for q in kube.list_custom("queues", namespace) if cluster_of(q) == name)
    if queues:
        reconciler.reconcile(namespace, name)
        message = (
            f"queues {', '.join(queues)} are placed on this cluster: delete them first (their data goes with them)"
        )
        if retry % DELETION_BLOCKED_EVERY == 0:  # an Event a minute, not one a pass
            kube.event(body, reason="DeletionBlocked", message=message, warning=True)
        # Not every second: kopf logs each retry at error level and posts it as an Event.
        raise kopf.TemporaryError(message, delay=ERROR_BACKOFF_S)
    try:
        reconciler.release(body)
    except ApplyRefused as refusal:
        # Held until it is gone: left behind, it would bind a later cluster of this name's servers.
        raise kopf.TemporaryError(f"{refusal}; the cluster goes once it is deleted", delay=ERROR_BACKOFF_S) from None
