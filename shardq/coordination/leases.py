"""The lease store: compare-and-swap records modelled on a coordination.k8s.io/v1 Lease.

One lease per shard names the leader. Its `transitions` count is the shard's epoch, the
fencing token stamped on log entries and receipts, and its annotations carry the in-sync
replica set, so a leader change and an ISR change are both one compare-and-swap on one record.
Methods are blocking; asyncio callers run them in a thread.
"""

from __future__ import annotations

import builtins
import dataclasses
from typing import Protocol

# The in-sync replica set, as comma-separated replica (server) names.
ISR_ANNOTATION = "shardq.io/isr"
# Which copy of each in-sync replica the ISR vouches for: `server=incarnation`,
# comma-separated. A replica whose data was wiped and recreated has a new
# incarnation, so the ISR's promise no longer covers it.
INCARNATIONS_ANNOTATION = "shardq.io/incarnations"
# Which creation of the shard's queue the lease is for (the cluster map's queue uid): a
# replica of another creation (the queue deleted and made again under its name while it
# ran) neither leads under it nor takes its leader's entries.
QUEUE_UID_ANNOTATION = "shardq.io/queue-uid"


class LeaseConflict(Exception):
    """The lease was written by someone else since it was read, or already exists."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One lease as stored. Records are values: build a changed copy with `fencing.build_*`.

    Times are wall-clock milliseconds since the epoch as written by the holder; 0 means
    never. `version` is opaque (a Kubernetes resourceVersion, or the local store's counter)
    and only ever compared for equality by the store that issued it; "" means not stored yet.
    """

    name: str
    holder: str = ""
    acquire_time_ms: int = 0
    renew_time_ms: int = 0
    duration_ms: int = 0
    transitions: int = 0
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    version: str = ""


class LeaseStore(Protocol):
    def get(self, name: str) -> LeaseRecord | None:
        """The lease as last written, or None if it was never created."""
        ...

    def create(self, record: LeaseRecord) -> LeaseRecord:
        """Store a new lease (its `version` is ignored) and return it with its version.

        Raises LeaseConflict if a lease of that name exists.
        """
        ...

    def update(self, record: LeaseRecord) -> LeaseRecord:
        """Replace the lease if it is still at `record.version`; return it with its new version.

        Raises LeaseConflict if the stored version differs (someone wrote in between) or
        the lease does not exist, and ValueError if `record.version` is "": an update
        without a version would be a blind overwrite, which fencing must never do.
        """
        ...

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        """Every lease whose name starts with `prefix`, ordered by name."""
        ...
