"""The chart's Grafana dashboard: every panel query parses (promtool checks them as
recording rules, with Grafana's variables filled in) and names only metrics the shard
server or the operator defines; the panels cover what issue 14 lists."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.binaries import Binaries, require
from e2e.helm import only, render
from e2e.prometheus import exported_metric_names

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

METRIC = re.compile(r"\bshardq_[a-z_]+\b")
# Grafana's variables, as a query sees them once filled in.
# Labels the chart's PodMonitor adds to every series (not metrics).
TARGET_LABELS = {"shardq_cluster", "shardq_role"}
VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$cluster": ".*", "$queue": ".*"}


def dashboard(binaries: Binaries) -> dict[str, Any]:
    config_map = only(render(binaries, "monitoring.dashboard.enabled=true"), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    loaded: dict[str, Any] = json.loads(config_map["data"]["shardq.json"])
    return loaded


def panel_queries(board: dict[str, Any]) -> dict[str, list[str]]:
    return {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in board["panels"]
        if panel["type"] != "row"
    }


def fill(query: str) -> str:
    for variable, value in VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query.replace('"$1"', ""), f"an unknown variable in {query}"
    return query


def test_every_panel_query_parses_and_names_defined_metrics(binaries: Binaries, tmp_path: Path) -> None:
    queries = [query for exprs in panel_queries(dashboard(binaries)).values() for query in exprs]
    assert len(queries) >= 20
    known = exported_metric_names()
    for query in queries:
        unknown = set(METRIC.findall(query)) - known - TARGET_LABELS
        assert not unknown, f"{query}: names no metric shardq defines: {unknown}"
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{n}", "expr": fill(q)} for n, q in enumerate(queries)],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    require(binaries.promtool)
    done = subprocess.run(
        [str(binaries.promtool), "check", "rules", str(path)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_refuses_a_broken_query(binaries: Binaries, tmp_path: Path) -> None:
    """The check above can fail."""
    path = tmp_path / "broken.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "d:q", "expr": "sum by (queue ("}]}]})
    )
    require(binaries.promtool)
    done = subprocess.run([str(binaries.promtool), "check", "rules", str(path)], capture_output=True, check=False)
    assert done.returncode != 0


def test_the_panels_cover_what_an_on_call_engineer_needs(binaries: Binaries) -> None:
    panels = panel_queries(dashboard(binaries))
    text = "\n".join(f"{title}: {' '.join(exprs)}" for title, exprs in panels.items())
    wanted = {
        "throughput per queue": r"Sends / s per queue: .*shardq_messages_sent_total",
        "throughput per shard": r"Sends / s per shard: .*by \(queue, shard\)",
        "depth": r"Depth per queue.*shardq_messages_visible",
        "oldest age": r"Oldest message age.*shardq_oldest_message_age_seconds",
        "in-flight": r"In flight per queue: .*shardq_messages_in_flight",
        "redeliveries": r"Redeliveries.*shardq_messages_redelivered_total",
        "dead letters": r"Dead-lettered.*shardq_messages_dead_lettered_total",
        "replication lag": r"Replication lag.*shardq_follower_lag_entries",
        "leaders per pod": r"Leaders per pod: count by \(pod\) \(shardq_shard_leader",
        "failovers": r"Failovers.*shardq_operator_takeovers_total",
        "request latency": r"Request latency.*histogram_quantile\(0\.99, .*shardq_request_duration_seconds_bucket",
        "disk commit time": r"Commit time.*histogram_quantile\(0\.99, .*shardq_commit_duration_seconds_bucket",
        "certificate expiry": r"TLS certificate: .*shardq_tls_certificate_expiration_timestamp_seconds.* - time\(\)",
    }
    missing = [what for what, pattern in wanted.items() if not re.search(pattern, text)]
    assert not missing, f"no panel for {missing}"
    variables = [variable["name"] for variable in dashboard(binaries)["templating"]["list"]]
    assert variables == ["datasource", "namespace", "cluster", "queue"]
