"""The commit index and the in-sync replica set, decided without servers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shard_server.runtime.replication.rules import commit_index, isr_after_check

FOLLOWERS = ("s2", "s3")


def test_an_entry_commits_once_every_in_sync_follower_holds_it() -> None:
    assert (
        commit_index(last_written=10, match={"s2": 10, "s3": 7}, followers=FOLLOWERS, isr={"s1", "s2", "s3"}, current=0)
        == 7
    )
    assert (
        commit_index(
            last_written=10, match={"s2": 10, "s3": 10}, followers=FOLLOWERS, isr={"s1", "s2", "s3"}, current=7
        )
        == 10
    )


def test_a_follower_outside_the_isr_does_not_hold_commits_back() -> None:
    assert (
        commit_index(last_written=10, match={"s2": 10, "s3": 0}, followers=FOLLOWERS, isr={"s1", "s2"}, current=0) == 10
    )


def test_a_leader_alone_commits_what_it_wrote() -> None:
    assert commit_index(last_written=5, match={}, followers=(), isr={"s1"}, current=0) == 5


def test_the_commit_index_never_goes_back() -> None:
    # s3 restarted empty and is still counted in sync: nothing answered is taken back.
    assert (
        commit_index(last_written=10, match={"s2": 10, "s3": 0}, followers=FOLLOWERS, isr={"s1", "s2", "s3"}, current=9)
        == 9
    )


@given(
    last=st.integers(0, 1_000),
    matches=st.tuples(st.integers(0, 1_000), st.integers(0, 1_000)),
    in_sync=st.sets(st.sampled_from(FOLLOWERS)),
    current=st.integers(0, 1_000),
)
def test_commit_is_at_least_where_it_was_and_never_past_an_in_sync_copy(
    last: int, matches: tuple[int, int], in_sync: set[str], current: int
) -> None:
    match = dict(zip(FOLLOWERS, matches, strict=True))
    result = commit_index(last_written=last, match=match, followers=FOLLOWERS, isr={"s1", *in_sync}, current=current)
    assert result >= current
    if result > current:
        assert result <= last
        assert all(match[follower] >= result for follower in in_sync)


def check(**overrides: object) -> frozenset[str]:
    view: dict[str, object] = {
        "leader": "s1",
        "followers": FOLLOWERS,
        "isr": {"s1", "s2", "s3"},
        "match": {"s2": 10, "s3": 10},
        "last_written": 10,
        "commit_index": 10,
        "known_incarnations": {"s1", "s2", "s3"},
        "progress_at_ms": {"s2": 1_000, "s3": 1_000},
        "now_ms": 1_500,
        "lag_ms": 1_000,
    }
    view.update(overrides)
    return isr_after_check(**view)  # type: ignore[arg-type]


def test_caught_up_followers_stay_in_sync() -> None:
    assert check() == {"s1", "s2", "s3"}


def test_a_follower_missing_a_committed_entry_leaves_at_once() -> None:
    assert check(match={"s2": 10, "s3": 4}, last_written=12) == {"s1", "s2"}


def test_a_follower_leaves_only_after_lagging_longer_than_the_bound() -> None:
    behind = {"match": {"s2": 10, "s3": 10}, "last_written": 14, "commit_index": 10}
    assert check(**behind, now_ms=1_900) == {"s1", "s2", "s3"}  # 900 ms without progress: still in
    assert check(**behind, now_ms=2_001, progress_at_ms={"s2": 1_950, "s3": 1_000}) == {"s1", "s2"}


def test_a_follower_rejoins_once_it_holds_everything_and_said_which_copy_it_is() -> None:
    assert check(isr={"s1", "s2"}, match={"s2": 10, "s3": 10}) == {"s1", "s2", "s3"}
    assert check(isr={"s1", "s2"}, known_incarnations={"s1", "s2"}) == {"s1", "s2"}
    assert check(isr={"s1", "s2"}, match={"s2": 10, "s3": 9}, commit_index=9) == {"s1", "s2"}


def test_the_leader_is_always_in_its_own_isr() -> None:
    assert "s1" in check(isr={"s2", "s3"})


def test_a_replica_moved_away_leaves_the_isr_and_a_new_one_joins_only_when_caught_up() -> None:
    # s3 moved to s4 in the cluster map: s3 is no longer a follower, s4 is copying.
    moving = {"followers": ("s2", "s4"), "match": {"s2": 10, "s4": 3}, "progress_at_ms": {"s2": 1_000, "s4": 1_400}}
    assert check(**moving) == {"s1", "s2"}
    assert check(**{**moving, "match": {"s2": 10, "s4": 10}, "known_incarnations": {"s1", "s2", "s4"}}) == {
        "s1",
        "s2",
        "s4",
    }
    # A moved-away replica no longer holds commits back either.
    moved_on = {"followers": ("s2", "s4"), "isr": {"s1", "s2", "s3"}}
    assert commit_index(last_written=10, match={"s2": 10}, current=0, **moved_on) == 10  # type: ignore[arg-type]
