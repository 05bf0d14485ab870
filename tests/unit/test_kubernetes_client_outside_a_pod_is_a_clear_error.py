"""Outside a pod, without a kubeconfig, there is no Kubernetes API to reach: the lease
store's connect (used by servers with --lease-store or --client-auth kubernetes, and by
the operator) says what to give instead of raising the client's own exception, which
ended `shardq serve` in a traceback."""

from __future__ import annotations

import pathlib

import pytest
from click.testing import CliRunner

from shard_server.cli import serve_command
from shardq.coordination.kubernetes_leases import connect


def test_connect_outside_a_pod_without_a_kubeconfig_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ValueError, match="outside a pod: give --kubeconfig"):
        connect(kubeconfig=None)


def test_serve_with_client_auth_outside_a_pod_is_one_line_and_a_non_zero_exit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    result = CliRunner().invoke(
        serve_command,
        ["--data-dir", str(tmp_path), "--port", "0", "--client-auth", "kubernetes", "--namespace", "shop"],
    )
    assert result.exit_code == 1
    assert "--client-auth kubernetes: no Kubernetes API client outside a pod: give --kubeconfig" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
