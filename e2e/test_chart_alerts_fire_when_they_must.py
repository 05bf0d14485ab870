"""The chart's PrometheusRule: promtool accepts it, and its unit tests
(charts/shardq/monitoring-tests/alerts_test.yaml) pass: every alert has synthetic series
that must fire it and series that must not, and a runbook paragraph in the chart's README."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.binaries import Binaries, require
from e2e.helm import CHART, only, render
from e2e.prometheus import exported_metric_names

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

UNIT_TESTS = CHART / "monitoring-tests" / "alerts_test.yaml"
# The values alerts_test.yaml was written for.
RULE_VALUES = (
    "monitoring.prometheusRule.enabled=true",
    "monitoring.prometheusRule.alerts.oldestMessage.perQueue.orders=300",
)


def promtool(binaries: Binaries, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    require(binaries.promtool)
    return subprocess.run(
        [str(binaries.promtool), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
    )


def rendered_groups(binaries: Binaries) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = only(render(binaries, *RULE_VALUES), "PrometheusRule")["spec"]["groups"]
    return groups


def alert_names(groups: list[dict[str, Any]]) -> set[str]:
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def write_rules(binaries: Binaries, directory: Path) -> None:
    (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": rendered_groups(binaries)}))
    shutil.copy(UNIT_TESTS, directory / "alerts_test.yaml")


def test_promtool_checks_the_rendered_rules(binaries: Binaries, tmp_path: Path) -> None:
    write_rules(binaries, tmp_path)
    done = promtool(binaries, "check", "rules", "rules.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 12 rules found" in done.stdout


def test_every_alert_has_unit_tests_that_fire_it_and_that_must_not(binaries: Binaries) -> None:
    alerts = alert_names(rendered_groups(binaries))
    assert len(alerts) == 8
    cases = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired: set[str] = set()
    silent: set[str] = set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else silent).add(check["alertname"])
    assert fired == alerts, "an evaluation where each alert fires"
    assert silent == alerts, "an evaluation where each alert must not fire"


def test_the_alert_unit_tests_pass(binaries: Binaries, tmp_path: Path) -> None:
    write_rules(binaries, tmp_path)
    done = promtool(binaries, "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_unit_tests_catch_a_broken_alert(binaries: Binaries, tmp_path: Path) -> None:
    """The unit tests can fail: with the shard-without-leader alert blind to a cluster
    that is down as a whole, they do."""
    write_rules(binaries, tmp_path)
    rules = yaml.safe_load((tmp_path / "rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "ShardqShardWithoutLeader":
                rule["expr"] = rule["expr"].split(" or ")[0]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    done = promtool(binaries, "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert done.returncode != 0
    assert "ShardqShardWithoutLeader" in done.stdout + done.stderr


def test_every_alert_has_a_runbook_paragraph_where_its_url_points(binaries: Binaries) -> None:
    readme = (CHART / "README.md").read_text()
    headings = set(re.findall(r"^### (Shardq\w+)$", readme, re.MULTILINE))
    groups = rendered_groups(binaries)
    assert alert_names(groups) <= headings
    for group in groups:
        for rule in group["rules"]:
            if "alert" in rule:
                url = rule["annotations"]["runbook_url"]
                assert url.endswith("charts/shardq/README.md#" + rule["alert"].lower()), url
                paragraph = readme.split(f"### {rule['alert']}\n", 1)[1].split("\n### ", 1)[0]
                assert len(paragraph.split()) > 40, f"{rule['alert']}: a real runbook paragraph"


def test_the_rules_name_only_metrics_shardq_defines(binaries: Binaries) -> None:
    """A renamed metric would silence an alert for good: every name the rules use is one
    the server or the operator exports (or a recording rule of the chart, or a label the
    PodMonitor adds)."""
    exposed = exported_metric_names()
    groups = rendered_groups(binaries)
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    for group in groups:
        for rule in group["rules"]:
            used = set(re.findall(r"\bshardq[:_][a-z_:0-9]+\b", rule["expr"]))
            unknown = used - exposed - recorded - {"shardq_cluster", "shardq_role"}
            assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown}"
