"""The queues created at run time, persisted in the data directory (queues.json).

A standalone server's command-line and --config queues are static; the ones
created with CreateQueue live here, with their settings as given (the names
and value syntax of `--queue name:key=value`), so a restart opens them again.
Written atomically: a crash leaves the old file or the new one, never half.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

from shard_server.storage.durable_files import replace_durably

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
        text = json.dumps({"queues": {name: dict(settings) for name, settings in sorted(queues.items())}}, indent=2)
        replace_durably(self.path, lambda out: out.write(text.encode() + b"\n"))
