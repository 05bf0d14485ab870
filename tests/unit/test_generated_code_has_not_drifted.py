"""The committed shardq/api/v1 code is exactly what the .proto files generate."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_has_not_drifted(tmp_path: pathlib.Path) -> None:
    spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "scripts" / "generate_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path)
    assert generated, "protoc produced nothing"
    committed_dir = ROOT / "shardq" / "api" / "v1"
    for path in generated:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is generated but not committed"
        assert committed.read_text() == module.rewrite_imports(path.read_text()), (
            f"{path.name} differs from the .proto files: run python scripts/generate_protos.py"
        )
    names = {p.name for p in generated}
    stale = {p.name for p in committed_dir.glob("*_pb2*")} - names
    assert not stale, f"committed files no proto generates: {stale}"
