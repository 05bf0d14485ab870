"""Small files replaced whole and durably: written beside, synced, renamed over, and the
rename synced in its directory, so a crash leaves the old file or the new, never half."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import BinaryIO


def replace_durably(path: pathlib.Path, write: Callable[[BinaryIO], object]) -> None:
    """Make `path` hold what `write` writes to the file it is given."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as out:
        write(out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
