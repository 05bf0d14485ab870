"""The chart tools that later tests use are installed and work: helm renders a chart and
promtool checks a rules file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2e.binaries import Binaries, require

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(60)]


def run(*args: str | Path) -> str:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_helm_reports_its_version_and_renders_a_chart(binaries: Binaries, tmp_path: Path) -> None:
    require(binaries.helm)
    assert binaries.helm_version in run(binaries.helm, "version", "--short")

    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("queue: orders\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Values.queue }}\n"
    )
    run(binaries.helm, "lint", chart)
    assert "name: orders" in run(binaries.helm, "template", "demo", chart)


def test_promtool_reports_its_version_and_checks_rules(binaries: Binaries, tmp_path: Path) -> None:
    require(binaries.promtool)
    assert "promtool, version" in run(binaries.promtool, "--version")

    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "groups:\n- name: shardq\n  rules:\n  - alert: ShardqDeadLetters\n    expr: shardq_dlq_depth > 0\n    for: 5m\n"
    )
    assert "SUCCESS" in run(binaries.promtool, "check", "rules", rules)

    broken = tmp_path / "broken.yaml"
    broken.write_text("groups:\n- name: x\n  rules:\n  - alert: Bad\n    expr: rate(\n")
    result = subprocess.run(
        [str(binaries.promtool), "check", "rules", str(broken)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
