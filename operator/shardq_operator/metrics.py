"""The operator's own /metrics: reconciles, errors, failovers, replica moves, and how long a shard was
without a serving leader after its leader's pod went away; over HTTPS when given a
certificate (`--metrics-tls-cert-file`), with its expiry."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Histogram

from shardq.coordination.takeovers import TakeoverReason
from shardq.metrics_http import CertificateExpiryCollector, start_metrics_server
from shardq.serving_certificates import ServingCertificate

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


def serve_metrics(address: str, port: int, certificate: ServingCertificate | None = None) -> None:
    """Serve /metrics from a daemon thread: over HTTPS with `certificate` (a renewal is
    served from the next scrape on), whose expiry is then a series of its own. Raises
    OSError if the port cannot be bound."""
    if certificate is not None:
        REGISTRY.register(
            CertificateExpiryCollector(
                certificate.expires_at,
                "When the certificate the operator presents on its metrics port expires (its"
                " notAfter, Unix seconds). A renewal whose files do not load leaves the old date here.",
            )
        )
    start_metrics_server(address, port, REGISTRY, None if certificate is None else certificate.ssl_context)
