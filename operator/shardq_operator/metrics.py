"""The operator's own /metrics: reconciles, errors, failovers, replica moves, and how long a shard was
without a serving leader after its leader's pod went away."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server

from shardq.coordination.takeovers import TakeoverReason

RECONCILES = Counter("shardq_operator_reconciles", "Reconciles of a ShardqCluster", ["cluster"])
RECONCILE_ERRORS = Counter("shardq_operator_reconcile_errors", "Reconciles that failed (retried)", ["cluster"])
TAKEOVERS = Counter(
    "shardq_operator_takeovers",
    "Shard leases taken over, by reason"
    " (holder-died, holder-restarted, lease-expired, lease-retaken, rebalance, replica-move)",
    ["cluster", "reason"],
)
REPLICA_MOVES = Counter(
    "shardq_operator_replica_moves",
    "Replica moves between servers (scale-out, scale-in, balance), by phase (started, finished)",
    ["cluster", "phase"],
)
FAILOVER_SECONDS = Histogram(
    "shardq_operator_failover_seconds",
    "From the moment the operator first saw a leader's server not running to the new lease written",
    ["cluster"],
    buckets=(0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60),
)

MOVE_PHASES = ("started", "finished")


def export_cluster(cluster: str) -> None:
    """Export every series of a cluster at zero before anything happens to it. A series
    that first appears already at 1 hides that increment from rate() and increase()
    (Prometheus has no earlier sample to compare with): the dashboard would never show a
    cluster's first failover, takeover, replica move or reconcile error, and the errors
    line would be missing instead of 0."""
    RECONCILE_ERRORS.labels(cluster)
    FAILOVER_SECONDS.labels(cluster)
    for reason in TakeoverReason:
        TAKEOVERS.labels(cluster, reason.value)
    for phase in MOVE_PHASES:
        REPLICA_MOVES.labels(cluster, phase)


def serve_metrics(address: str, port: int) -> None:
    start_http_server(port, addr=address, registry=REGISTRY)
