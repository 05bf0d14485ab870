"""Running helm on charts/shardq for the chart tests: render, lint, install."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from e2e.binaries import Binaries, require

CHART = Path(__file__).resolve().parent.parent / "charts" / "shardq"
RELEASE = "shardq"
HELM_TIMEOUT_S = 60.0

# Every switch of values.yaml turned on (the optional resources all rendered).
EVERY_SWITCH = (
    "cluster.create=true",
    "examples.enabled=true",
    "monitoring.podMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.dashboard.enabled=true",
    "monitoring.prometheusRule.alerts.oldestMessage.perQueue.orders=300",
    "queues[0].name=audit",
    "queues[0].spec.fifo=true",
    "cluster.clientAuthentication.mode=kubernetes",
    "cluster.tls.secretName=shardq-tls",
)


def helm(binaries: Binaries, *args: str | Path, timeout: float = HELM_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run helm; the caller checks the outcome (refusals are what some tests want)."""
    require(binaries.helm)
    return subprocess.run(
        [str(binaries.helm), *(str(a) for a in args)], capture_output=True, text=True, timeout=timeout, check=False
    )


def template_args(*sets: str, namespace: str = "shardq-system", release: str = RELEASE) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for value in sets:
        args += ["--set", value]
    return args


def render(
    binaries: Binaries, *sets: str, namespace: str = "shardq-system", release: str = RELEASE
) -> list[dict[str, Any]]:
    """The manifests `helm template` makes with these --set values (hooks and tests included)."""
    done = helm(binaries, *template_args(*sets, namespace=namespace, release=release))
    assert done.returncode == 0, f"helm template {sets} failed:\n{done.stderr}"
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def kinds_and_names(manifests: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(m["kind"], m["metadata"]["name"]) for m in manifests}


def only(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == kind]
    return found
