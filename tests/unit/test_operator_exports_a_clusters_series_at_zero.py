"""The operator exports a cluster's error, takeover, replica-move and failover series at 0
before anything happens to it, so the dashboard's rate() and increase() see the first
failover or move as an increase (a series first scraped at 1 shows none)."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from shardq_operator import metrics

from shardq.coordination.takeovers import TakeoverReason


def samples(cluster: str) -> dict[tuple[str, str], float]:
    text = generate_latest(REGISTRY).decode()
    return {
        (sample.name, sample.labels.get("reason") or sample.labels.get("phase") or sample.labels.get("le", "")): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        # `_created` holds a timestamp, not a count.
        if sample.labels.get("cluster") == cluster and not sample.name.endswith("_created")
    }


def test_a_reconciled_cluster_has_every_series_at_zero_before_any_event() -> None:
    cluster = "unit/never-failed-over"
    assert samples(cluster) == {}
    metrics.export_cluster(cluster)
    found = samples(cluster)
    assert found[("shardq_operator_reconcile_errors_total", "")] == 0
    assert {reason for name, reason in found if name == "shardq_operator_takeovers_total"} == {
        reason.value for reason in TakeoverReason
    }
    assert found[("shardq_operator_replica_moves_total", "started")] == 0
    assert found[("shardq_operator_replica_moves_total", "finished")] == 0
    assert found[("shardq_operator_failover_seconds_count", "")] == 0
    assert found[("shardq_operator_failover_seconds_bucket", "+Inf")] == 0
    assert all(value == 0 for value in found.values())


def test_exporting_again_keeps_what_was_counted() -> None:
    cluster = "unit/failed-over-once"
    metrics.export_cluster(cluster)
    metrics.TAKEOVERS.labels(cluster, TakeoverReason.HOLDER_DIED.value).inc()
    metrics.export_cluster(cluster)
    assert samples(cluster)[("shardq_operator_takeovers_total", TakeoverReason.HOLDER_DIED.value)] == 1
