"""Regenerate shardq/api/v1 from proto/shardq/v1 (grpcio-tools + mypy-protobuf).

Run from anywhere: `python scripts/generate_protos.py [--out DIR]`. The drift
test generates into a temporary directory and compares with the committed files.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "shardq" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "shardq" / "v1").glob("*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if args.out is not None:
        generate(args.out)
        return
    # protoc writes by package path; the committed copy lives at shardq/api/v1,
    # so generate next to it and move the files, rewriting the import path.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(pathlib.Path(tmp)):
            text = rewrite_imports(path.read_text())
            (ROOT / "shardq" / "api" / "v1" / path.name).write_text(text)
    print("generated", file=sys.stderr)


def rewrite_imports(text: str) -> str:
    """Point the generated imports at shardq.api.v1 instead of shardq.v1."""
    return text.replace("from shardq.v1 import", "from shardq.api.v1 import").replace(
        "import shardq.v1.", "import shardq.api.v1."
    )


if __name__ == "__main__":
    main()
