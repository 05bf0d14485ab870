"""`e2e/cluster down` and its leftover check on a host where the node's packages are not
installed yet (no iptables): there are no rules of ours to find or drop, and no error.
Before, `down` failed there with FileNotFoundError on iptables-save."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import realnode


def test_no_iptables_means_no_rules_of_ours_and_nothing_to_drop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a real lookup that finds no iptables-save
    for tool in ("iptables", "ip6tables"):
        assert realnode._iptables_rules_of_ours(tool) == []
        realnode._drop_iptables_rules(tool)
