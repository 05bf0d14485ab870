"""Streaming offsets over a queue's journal, and how far one micro-batch may go.

Pure: no pyspark, no gRPC. An offset is, per shard, the next log index to read
(the `next_index` a JournalBatch returns); as JSON for Spark's checkpoint it is
`{"0": 17, "1": 5}` (JSON object keys are strings). A micro-batch reads the
half-open range [start, end) of every shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

# shard -> next log index to read. Log indexes start at 1.
ShardOffsets = dict[int, int]

FIRST_LOG_INDEX = 1


def offsets_to_json(offsets: Mapping[int, int]) -> dict[str, int]:
    return {str(shard): offsets[shard] for shard in sorted(offsets)}


def offsets_from_json(decoded: object) -> ShardOffsets:
    if not isinstance(decoded, dict):
        raise ValueError(f"offsets must be a JSON object of shard -> log index, got {decoded!r}")
    offsets: ShardOffsets = {}
    for key, value in decoded.items():
        if not isinstance(key, str) or not key.isdigit():
            raise ValueError(f"offset key must be a shard number, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < FIRST_LOG_INDEX:
            raise ValueError(f"offset of shard {key} must be a log index >= 1, got {value!r}")
        offsets[int(key)] = value
    return offsets


@dataclasses.dataclass(frozen=True, slots=True)
class ShardBacklog:
    """What one shard has to read: log indexes [start, end) and their event counts."""

    start: int
    end: int
    # (log_index, number of events) for the indexes in [start, end) that hold
    # events, ascending. The driver stops counting early, so it may not reach `end`.
    groups: Sequence[tuple[int, int]]
    # True when `groups` describes the whole range up to `end`.
    complete: bool


def compute_capped_end(backlogs: Mapping[int, ShardBacklog], max_rows: int) -> ShardOffsets:
    """End offsets that admit at most `max_rows` events in total, shared fairly.

    Shards take whole log indexes in turn (round-robin), so a busy shard cannot
    starve the others. A log index is never split, since offsets cannot point
    inside one; when every shard's next index alone holds more than
    `max_rows` events, the smallest of those is admitted anyway so the query
    keeps moving: only then does a batch exceed the limit.
    """
    budget = max_rows
    taken = dict.fromkeys(backlogs, 0)
    admitted_any = True
    while admitted_any:
        admitted_any = False
        for shard in sorted(backlogs):
            groups = backlogs[shard].groups
            position = taken[shard]
            if position < len(groups) and groups[position][1] <= budget:
                budget -= groups[position][1]
                taken[shard] = position + 1
                admitted_any = True
    if budget == max_rows:
        waiting = [(groups[0][1], shard) for shard, b in backlogs.items() if (groups := b.groups)]
        if waiting:
            _, shard = min(waiting)
            taken[shard] = 1
    ends: ShardOffsets = {}
    for shard, backlog in backlogs.items():
        position = taken[shard]
        if position == len(backlog.groups) and backlog.complete:
            # Everything counted was admitted; skip trailing indexes without events too.
            ends[shard] = backlog.end
        elif position == 0:
            ends[shard] = backlog.start
        else:
            ends[shard] = backlog.groups[position - 1][0] + 1
    return ends


def compute_bounded_latest(latest: Mapping[int, int], target: Mapping[int, int] | None) -> ShardOffsets:
    """`latest`, but never beyond an Trigger.AvailableNow target fixed earlier.

    Shards that appeared after the target was fixed are left out: their data
    arrived after the query was told to stop at what was available.
    """
    if target is None:
        return dict(latest)
    return {shard: min(latest[shard], target[shard]) for shard in latest if shard in target}


def compute_start_offsets(start: Mapping[int, int], first_indexes: Mapping[int, int]) -> ShardOffsets:
    """`start` plus shards it does not know yet (added since), read from their beginning."""
    offsets = dict(start)
    for shard, first_index in first_indexes.items():
        offsets.setdefault(shard, max(first_index, FIRST_LOG_INDEX))
    return offsets
