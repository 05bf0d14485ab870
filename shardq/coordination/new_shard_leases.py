"""Writing the lease of a newly placed shard while others write it too.

When a queue is made again under the name of a deleted one, its shards' leases are still
there, and the old creation's leaders go on renewing them until they see the new map. A
read of the lease and the write of its next epoch can therefore fall either side of a
renewal; the store then refuses the write (LeaseConflict). That refusal says only that the
lease moved: the new shard's lease is built again from what is there now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shardq.coordination.cluster_map import lease_name
from shardq.coordination.leases import LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import lease_for_new_shard

# A holder renews a few times per lease duration, and one read-and-write takes a few
# milliseconds: losing five in a row means something else is writing the lease in a loop,
# which the caller should hear about rather than race forever.
NEW_SHARD_LEASE_ATTEMPTS = 5


def write_lease_for_new_shard(
    store: LeaseStore,
    *,
    shard: ShardId,
    replicas: Sequence[str],
    now_ms: Callable[[], int],
    duration_ms: int,
    queue_uid: str,
) -> LeaseRecord:
    """Create the shard's lease, or move a namesake's left lease to the next epoch
    (`lease_for_new_shard`), reading it again whenever someone wrote it in between; the
    lease as stored. The last of NEW_SHARD_LEASE_ATTEMPTS raises its LeaseConflict."""

    def attempt() -> LeaseRecord:
        existing = store.get(lease_name(shard))
        record = lease_for_new_shard(
            existing,
            shard=shard,
            replicas=replicas,
            now_ms=now_ms(),
            duration_ms=duration_ms,
            queue_uid=queue_uid,
        )
        return store.create(record) if existing is None else store.update(record)

    for _ in range(NEW_SHARD_LEASE_ATTEMPTS - 1):
        try:
            return attempt()
        except LeaseConflict:
            continue  # someone wrote it since it was read: read it again
    return attempt()
