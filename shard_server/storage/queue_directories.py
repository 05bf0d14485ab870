"""Which creation of a queue a server's data directory for it holds.

A queue deleted and made again under its name is another queue: its messages, its log
and its epochs start afresh (a cluster deleted and made again starts its leases again at
epoch 1, too). A volume retained or restored from before the deletion can still hold the
old creation's data under the same name, with a log whose entries the new leader's would
seem to match by index and epoch. So the directory records the uid of the creation it
holds (`UID_FILE`), and a server asked to host another creation discards what it holds
first. A directory without the file (made before uids, or by a map that names none) is
taken as the named creation's.
"""

from __future__ import annotations

import logging
import pathlib
import shutil

from shard_server.storage.durable_files import replace_durably

log = logging.getLogger(__name__)

UID_FILE = "queue-uid"
# Queue names never start with a dot (`check_queue_name`), so this cannot be a queue's.
_DISCARDED_PREFIX = ".discarded-"


def held_uid(directory: pathlib.Path) -> str:
    """The uid of the creation `directory` holds ("" when it does not say)."""
    try:
        return (directory / UID_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def claim_queue_directory(directory: pathlib.Path, uid: str) -> str:
    """Make `directory` hold creation `uid` of its queue; the uid of another creation
    whose data was discarded to do so ("" when none was). An empty `uid` claims nothing.

    The old data is renamed away before it is deleted, and the new uid written after:
    a server killed in between finds either the old creation's file, and discards
    again, or no directory, and the discarded one is deleted on the next claim."""
    if not uid:
        return ""
    discarded = directory.with_name(f"{_DISCARDED_PREFIX}{directory.name}")
    if discarded.exists():  # left by a server killed while deleting it
        shutil.rmtree(discarded)
    held = held_uid(directory)
    if held == uid:
        return ""
    if held:
        directory.rename(discarded)
        shutil.rmtree(discarded)
        log.warning(
            "queue %s: this server held the data of another queue of that name (uid %s, now uid %s); "
            "that queue was deleted, so its data here is deleted too",
            directory.name,
            held,
            uid,
        )
    directory.mkdir(parents=True, exist_ok=True)
    replace_durably(directory / UID_FILE, lambda out: out.write(uid.encode() + b"\n"))
    return held
