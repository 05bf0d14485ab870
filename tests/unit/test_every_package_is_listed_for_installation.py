"""pyproject.toml lists the packages (the operator's directory is not its import name):
a package directory missing from the list would be left out of wheels and images."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("shardq", "shard_server")
        for init in (ROOT / top).rglob("__init__.py")
    }
    operator_root = ROOT / setuptools["package-dir"]["shardq_operator"]
    found |= {
        ".".join(("shardq_operator", *init.parent.relative_to(operator_root).parts))
        for init in operator_root.rglob("__init__.py")
    }
    assert found == listed, (
        f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
    )
