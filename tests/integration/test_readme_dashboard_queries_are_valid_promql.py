"""The dashboard queries the README documents parse (promtool checks them as
recording rules) and name only metrics the server defines."""

from __future__ import annotations

import pathlib
import re
import subprocess

import yaml

from e2e.binaries import locate_binaries, require

ROOT = pathlib.Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bshardq_[a-z_]+\b")


def readme_queries() -> list[str]:
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```promql\n(.*?)```", text, re.DOTALL)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def defined_metric_names() -> set[str]:
    """Names as exposed: counters get _total, histograms _bucket/_sum/_count, Info _info."""
    source = (ROOT / "shard_server" / "metrics.py").read_text()
    exposed = set()
    for name in re.findall(r'"(shardq_[a-z_]+)"', source):
        exposed |= {name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_info"}
    return exposed


def test_every_readme_query_parses_and_names_defined_metrics(tmp_path: pathlib.Path) -> None:
    queries = readme_queries()
    assert len(queries) >= 10
    known = defined_metric_names()
    for query in queries:
        unknown = set(METRIC.findall(query)) - known
        assert not unknown, f"{query}: names no metric the server defines: {unknown}"
    rules = {
        "groups": [
            {"name": "readme", "rules": [{"record": f"readme:query_{n}", "expr": q} for n, q in enumerate(queries)]}
        ]
    }
    path = tmp_path / "readme-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    promtool = locate_binaries().promtool
    require(promtool)
    done = subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
