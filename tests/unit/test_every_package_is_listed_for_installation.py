"""pyproject.toml lists the packages (the operator's directory is not its import name):
a package directory missing from the list would be left out of wheels and images."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

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


def test_the_wheel_marks_the_client_as_typed(tmp_path: pathlib.Path) -> None:
    """Without `shardq/py.typed` in the wheel, mypy treats `import shardq` in an
    application as untyped (an error under --strict) and checks none of its calls."""
    # Built from a copy of what the wheel takes: setuptools reuses a checkout's build/
    # directory, where a file deleted from the tree lives on.
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    for top in ("shardq", "shard_server", "operator"):
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("shardq-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "shardq/py.typed" in archive.namelist()
