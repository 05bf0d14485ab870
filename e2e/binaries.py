"""Where e2e/controlplane/build.sh puts the binaries the e2e tests run.

The versions are read from e2e/controlplane/versions.env, the same file build.sh
sources, so the two cannot disagree about which cache directory is current.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

VERSIONS_FILE = Path(__file__).parent / "controlplane" / "versions.env"
BUILD_SCRIPT = Path(__file__).parent / "controlplane" / "build.sh"


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    etcd: Path
    helm: Path
    promtool: Path
    prometheus: Path
    kubernetes_version: str
    etcd_version: str
    helm_version: str


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """The KEY=VALUE lines of versions.env (comments and blank lines skipped)."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not a KEY=VALUE line: {line!r}")
        versions[key.strip()] = value.strip()
    return versions


def cache_root() -> Path:
    """${XDG_CACHE_HOME:-$HOME/.cache}/shardq, as build.sh computes it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardq"


def locate_binaries() -> Binaries:
    versions = read_versions()
    root = cache_root()
    k8s = root / f"k8s-{versions['K8S_VERSION']}" / "bin"
    return Binaries(
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kubectl=k8s / "kubectl",
        etcd=root / f"etcd-{versions['ETCD_VERSION']}" / "bin" / "etcd",
        helm=root / f"helm-{versions['HELM_VERSION']}" / "bin" / "helm",
        promtool=root / "promtool-debian" / "bin" / "promtool",
        prometheus=root / f"prometheus-{versions['PROMETHEUS_VERSION']}" / "bin" / "prometheus",
        kubernetes_version=versions["K8S_VERSION"],
        etcd_version=versions["ETCD_VERSION"],
        helm_version=versions["HELM_VERSION"],
    )


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(*paths: Path) -> None:
    """Skip the test when a binary is missing on a developer's machine; fail it in CI.

    CI runs build.sh first, so a missing binary there is a broken pipeline, never a
    reason to skip silently.
    """
    missing = [str(p) for p in paths if not os.access(p, os.X_OK)]
    if not missing:
        return
    message = f"missing e2e binaries {missing}; build them with {BUILD_SCRIPT}"
    if running_in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
