"""The control plane is the pinned release, and kubectl works with the kubeconfig that
the fixtures hand to tests (the operator and helm will use the same file)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kubernetes import client

from e2e.binaries import Binaries, require
from e2e.kubecluster import ControlPlane

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]


def test_server_is_the_pinned_release(control_plane: ControlPlane, api_client: client.ApiClient) -> None:
    info = client.VersionApi(api_client).get_code()
    assert info.git_version == control_plane.kubernetes_version


def test_kubectl_reads_the_namespace_through_the_kubeconfig(
    binaries: Binaries, kubeconfig: Path, namespace: str
) -> None:
    require(binaries.kubectl)
    result = subprocess.run(
        [
            str(binaries.kubectl),
            f"--kubeconfig={kubeconfig}",
            "get",
            "namespace",
            namespace,
            "-o",
            "name",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"namespace/{namespace}"
