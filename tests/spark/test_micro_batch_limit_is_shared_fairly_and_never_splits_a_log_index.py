"""How far one streaming micro-batch may read (pure: no Spark, no server)."""

from __future__ import annotations

import pytest

from shardq.spark.offsets import (
    ShardBacklog,
    compute_bounded_latest,
    compute_capped_end,
    compute_start_offsets,
    offsets_from_json,
    offsets_to_json,
)


def backlog(start: int, end: int, *counts: int, complete: bool = True) -> ShardBacklog:
    """Log indexes start, start+1, ... holding `counts` events each."""
    return ShardBacklog(start=start, end=end, groups=[(start + i, n) for i, n in enumerate(counts)], complete=complete)


def test_everything_fits_reads_to_the_end_including_trailing_indexes_without_events() -> None:
    assert compute_capped_end({0: backlog(1, 9, 1, 1, 1)}, max_rows=10) == {0: 9}


def test_rows_are_shared_round_robin_between_busy_shards() -> None:
    ends = compute_capped_end({0: backlog(1, 101, *[1] * 100), 1: backlog(5, 105, *[1] * 100)}, max_rows=10)
    assert ends == {0: 6, 1: 10}


def test_a_quiet_shard_leaves_its_share_to_the_busy_one() -> None:
    ends = compute_capped_end({0: backlog(1, 101, *[1] * 100), 1: backlog(7, 8, 1)}, max_rows=10)
    assert ends == {0: 10, 1: 8}


def test_a_log_index_is_never_split() -> None:
    # Index 2 holds 5 events: taking it would exceed the limit, so the batch stops before it.
    assert compute_capped_end({0: backlog(1, 4, 3, 5, 1)}, max_rows=6) == {0: 2}


def test_an_index_larger_than_the_limit_is_admitted_alone_so_the_query_moves() -> None:
    ends = compute_capped_end({0: backlog(1, 3, 50, 1), 1: backlog(1, 2, 20)}, max_rows=10)
    assert ends == {0: 1, 1: 2}


def test_a_shard_counted_only_partly_ends_at_its_last_counted_index() -> None:
    ends = compute_capped_end({0: backlog(1, 1000, 1, 1, 1, complete=False)}, max_rows=2)
    assert ends == {0: 3}


def test_nothing_new_keeps_the_start() -> None:
    assert compute_capped_end({0: backlog(4, 4), 1: backlog(9, 9)}, max_rows=5) == {0: 4, 1: 9}


def test_available_now_target_caps_latest_and_excludes_shards_added_later() -> None:
    assert compute_bounded_latest({0: 50, 1: 7, 2: 3}, {0: 40, 1: 9}) == {0: 40, 1: 7}
    assert compute_bounded_latest({0: 50}, None) == {0: 50}


def test_shards_added_since_the_checkpoint_start_at_their_first_retained_index() -> None:
    assert compute_start_offsets({0: 17}, {0: 1, 1: 4, 2: 0}) == {0: 17, 1: 4, 2: 1}


def test_offsets_round_trip_through_json_and_bad_ones_are_refused() -> None:
    assert offsets_from_json(offsets_to_json({1: 5, 0: 17})) == {0: 17, 1: 5}
    assert list(offsets_to_json({1: 5, 0: 17})) == ["0", "1"]
    for bad in ([1, 2], {"a": 1}, {"0": 0}, {"0": "5"}, {"0": True}):
        with pytest.raises(ValueError, match="offset"):
            offsets_from_json(bad)
