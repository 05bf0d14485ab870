"""Pure replication decisions: what is committed, and who is in sync.

No clock, no I/O: the replica passes its view (matched log indexes, progress times,
`now_ms`) and acts on the answer, so each rule is tested without servers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def commit_index(
    *,
    last_written: int,
    match: Mapping[str, int],
    followers: Iterable[str],
    isr: Iterable[str],
    current: int,
) -> int:
    """The leader's commit index: the highest entry every in-sync follower holds (and the
    leader wrote). It never goes back: an ISR that shrank or a follower that restarted
    empty cannot un-commit what was answered."""
    in_sync = set(isr)
    held = [last_written, *(match.get(follower, 0) for follower in followers if follower in in_sync)]
    return max(current, min(held))


def isr_after_check(
    *,
    leader: str,
    followers: Iterable[str],
    isr: Iterable[str],
    match: Mapping[str, int],
    last_written: int,
    commit_index: int,
    known_incarnations: Iterable[str],
    progress_at_ms: Mapping[str, int],
    now_ms: int,
    lag_ms: int,
) -> frozenset[str]:
    """The in-sync replica set the leader should record now.

    A member leaves when it lacks a committed entry (it restarted empty or cut its tail:
    promoting it could lose acknowledged writes) or has made no progress towards the
    leader's last entry for longer than `lag_ms`. A follower rejoins once it holds every
    entry the leader wrote and has told which copy of the data it holds (its incarnation).
    The leader is always in its own ISR. A member that is no longer one of the shard's
    replicas (moved away in the cluster map) leaves it: it stops receiving entries.
    """
    incarnations = set(known_incarnations)
    followers = list(followers)
    wanted = set(isr) & {leader, *followers}
    for follower in followers:
        held = match.get(follower, 0)
        caught_up = held >= last_written and follower in incarnations
        lagging = not caught_up and now_ms - progress_at_ms.get(follower, now_ms) > lag_ms
        if follower in wanted and (held < commit_index or lagging):
            wanted.discard(follower)
        elif follower not in wanted and caught_up:
            wanted.add(follower)
    wanted.add(leader)
    return frozenset(wanted)
