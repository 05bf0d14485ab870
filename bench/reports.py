"""How every benchmark here hands over its result: JSON on stdout, and a file with --out."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def emit(report: dict[str, Any], out: pathlib.Path | None, file_name: str) -> None:
    """Print `report` as JSON; with `out`, also write it to out/file_name."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / file_name).write_text(text + "\n")
