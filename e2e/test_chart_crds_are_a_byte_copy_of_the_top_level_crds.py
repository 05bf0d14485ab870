"""The chart installs the CRDs of `crds/` unchanged: its `crds/` is a byte copy (helm
installs a chart's `crds/` once and never upgrades them, so a drift would go unnoticed)."""

from __future__ import annotations

from pathlib import Path

from e2e.helm import CHART

TOP_LEVEL = Path(__file__).resolve().parent.parent / "crds"


def test_the_chart_crds_are_the_top_level_crds_byte_for_byte() -> None:
    top = {path.name: path.read_bytes() for path in sorted(TOP_LEVEL.glob("*"))}
    copy = {path.name: path.read_bytes() for path in sorted((CHART / "crds").glob("*"))}
    assert len(top) == 3
    assert sorted(copy) == sorted(top), "the same files"
    changed = [name for name in top if copy[name] != top[name]]
    assert not changed, f"charts/shardq/crds/ differs from crds/ in {changed}: cp crds/*.yaml charts/shardq/crds/"
