"""The queues created at run time, persisted in the data directory (queues.json).

A standalone server's command-line and --config queues are static; the ones
created with CreateQueue live here, with their settings as given (the names
and value syntax of `--queue name:key=value`), so a restart opens them again.
Written atomically: a crash leaves the old file or the new one, never half.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping

CATALOG_FILE = "queues.json"


class QueueCatalog:
    def __init__(self, data_dir: pathlib.Path) -> None:
        self.path = data_dir / CATALOG_FILE

    def load(self) -> dict[str, dict[str, str]]:
        """{queue: settings} of every queue created at run time."""
        if not self.path.exists():
            return {}
        data = json.loads(self.path.read_text())
        queues = data.get("queues", {})
        if not isinstance(queues, dict):
            raise ValueError(f"{self.path}: 'queues' must be a mapping")
        return {str(name): {str(k): str(v) for k, v in settings.items()} for name, settings in queues.items()}

    def save(self, queues: Mapping[str, Mapping[str, str]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")
        with partial.open("w") as out:
            json.dump({"queues": {name: dict(settings) for name, settings in sorted(queues.items())}}, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
