"""The fencing rules on lease records: when a lease is gone, what a takeover and a renewal
change, how the ISR is recorded, and that a leader stops serving before anyone may take over."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardq.coordination.fencing import (
    EPOCH_LIMIT,
    build_epoch_raise,
    build_isr_change,
    build_renewal,
    build_takeover,
    for_another_creation,
    is_expired,
    isr_of,
    safe_serving_deadline_ms,
)
from shardq.coordination.leases import ISR_ANNOTATION, LeaseRecord
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import lease_for_new_shard

T0 = 1_763_771_298_000
DURATION_MS = 10_000


def held(holder: str = "server-1", *, renewed_at: int = T0, transitions: int = 4) -> LeaseRecord:
    return LeaseRecord(
        name="orders-0",
        holder=holder,
        acquire_time_ms=T0 - 60_000,
        renew_time_ms=renewed_at,
        duration_ms=DURATION_MS,
        transitions=transitions,
        annotations={ISR_ANNOTATION: "server-1,server-2", "team": "payments"},
        version="17",
    )


class TestExpiry:
    def test_lease_holds_until_the_last_millisecond_of_its_duration(self) -> None:
        assert not is_expired(held(), T0)
        assert not is_expired(held(), T0 + DURATION_MS - 1)

    def test_lease_is_gone_once_its_duration_has_passed(self) -> None:
        assert is_expired(held(), T0 + DURATION_MS)
        assert is_expired(held(), T0 + DURATION_MS + 1)

    def test_lease_without_holder_protects_nobody(self) -> None:
        free = LeaseRecord(name="orders-0", renew_time_ms=T0, duration_ms=DURATION_MS)
        assert is_expired(free, T0)

    def test_renewal_pushes_expiry_out(self) -> None:
        renewed = build_renewal(held(), now_ms=T0 + 5_000)
        assert not is_expired(renewed, T0 + DURATION_MS)
        assert is_expired(renewed, T0 + 5_000 + DURATION_MS)


class TestTakeoverAndRenewal:
    def test_takeover_by_another_server_opens_the_next_epoch(self) -> None:
        taken = build_takeover(held(), new_holder="server-2", now_ms=T0 + 20_000, duration_ms=3_000)

        assert taken.holder == "server-2"
        assert taken.transitions == 5
        assert (taken.acquire_time_ms, taken.renew_time_ms, taken.duration_ms) == (T0 + 20_000, T0 + 20_000, 3_000)

    def test_takeover_by_the_previous_holder_still_opens_a_new_epoch(self) -> None:
        # A restarted server keeps its name but not what it answered before the crash.
        taken = build_takeover(held(), new_holder="server-1", now_ms=T0 + 20_000, duration_ms=DURATION_MS)
        assert taken.transitions == 5

    def test_takeover_keeps_name_version_and_annotations(self) -> None:
        before = held()
        taken = build_takeover(before, new_holder="server-2", now_ms=T0, duration_ms=DURATION_MS)

        assert (taken.name, taken.version) == (before.name, before.version)
        assert taken.annotations == before.annotations
        assert taken.annotations is not before.annotations

    def test_renewal_keeps_holder_epoch_and_acquire_time(self) -> None:
        before = held()
        renewed = build_renewal(before, now_ms=T0 + 2_500)

        assert (renewed.holder, renewed.transitions, renewed.acquire_time_ms) == (
            before.holder,
            before.transitions,
            before.acquire_time_ms,
        )
        assert renewed.renew_time_ms == T0 + 2_500
        assert renewed.version == before.version

    def test_free_lease_cannot_be_renewed(self) -> None:
        with pytest.raises(ValueError, match="no holder"):
            build_renewal(LeaseRecord(name="orders-0"), now_ms=T0)

    @pytest.mark.parametrize(("holder", "duration_ms"), [("", DURATION_MS), ("server-2", 0), ("server-2", -1)])
    def test_takeover_needs_a_holder_and_a_duration(self, holder: str, duration_ms: int) -> None:
        with pytest.raises(ValueError, match=r"holder|duration"):
            build_takeover(held(), new_holder=holder, now_ms=T0, duration_ms=duration_ms)

    @given(st.lists(st.sampled_from(["renew", "server-1", "server-2", "server-3"]), max_size=30))
    def test_epoch_counts_exactly_the_takeovers(self, steps: list[str]) -> None:
        record = LeaseRecord(name="orders-0")
        takeovers = 0
        for now_ms, step in enumerate(steps, start=T0):
            if step == "renew":
                if record.holder:
                    record = build_renewal(record, now_ms=now_ms)
            else:
                record = build_takeover(record, new_holder=step, now_ms=now_ms, duration_ms=DURATION_MS)
                takeovers += 1
        assert record.transitions == takeovers


class TestIsr:
    def test_isr_round_trips_as_a_set(self) -> None:
        changed = build_isr_change(held(), ["server-3", "server-1", "server-3"])

        assert isr_of(changed) == {"server-1", "server-3"}
        assert changed.annotations[ISR_ANNOTATION] == "server-1,server-3"
        assert changed.annotations["team"] == "payments"

    def test_isr_change_keeps_holder_and_epoch(self) -> None:
        before = held()
        changed = build_isr_change(before, ["server-1"])
        assert (changed.holder, changed.transitions, changed.renew_time_ms) == (
            before.holder,
            before.transitions,
            before.renew_time_ms,
        )
        assert isr_of(before) == {"server-1", "server-2"}

    def test_lease_without_isr_annotation_has_an_empty_isr(self) -> None:
        assert isr_of(LeaseRecord(name="orders-0")) == frozenset()

    def test_isr_must_contain_the_leader(self) -> None:
        with pytest.raises(ValueError, match="leader"):
            build_isr_change(held("server-1"), ["server-2", "server-3"])

    def test_free_lease_may_record_any_isr(self) -> None:
        assert isr_of(build_isr_change(LeaseRecord(name="orders-0"), ["server-2"])) == {"server-2"}

    @pytest.mark.parametrize("bad_name", ["", "a,b", " server-1"])
    def test_isr_rejects_names_the_annotation_cannot_carry(self, bad_name: str) -> None:
        with pytest.raises(ValueError, match="replica name"):
            build_isr_change(LeaseRecord(name="orders-0"), [bad_name])

    @given(st.frozensets(st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}", fullmatch=True), max_size=5))
    def test_any_valid_isr_round_trips(self, members: frozenset[str]) -> None:
        assert isr_of(build_isr_change(LeaseRecord(name="orders-0"), members)) == members


class TestSafeServingDeadline:
    def test_deadline_counts_from_the_start_of_the_renew_request(self) -> None:
        assert safe_serving_deadline_ms(50_000, duration_ms=DURATION_MS, clock_skew_margin_ms=1_000) == 59_000

    @given(
        renew_started=st.integers(min_value=0, max_value=10**12),
        wall_read_delay=st.integers(min_value=0, max_value=1_000),
        holder_skew=st.integers(min_value=-60_000, max_value=60_000),
        duration_ms=st.integers(min_value=1, max_value=600_000),
        data=st.data(),
    )
    def test_leader_stops_before_anyone_sees_its_lease_expire(
        self, renew_started: int, wall_read_delay: int, holder_skew: int, duration_ms: int, data: st.DataObject
    ) -> None:
        # True time is the holder's monotonic clock. Wall clocks are true time plus a skew;
        # the judge (a contender, the operator) may differ from the holder by up to the margin.
        margin = data.draw(st.integers(min_value=0, max_value=duration_ms - 1))
        judge_skew = holder_skew + data.draw(st.integers(min_value=-margin, max_value=margin))
        # The holder reads its monotonic clock first, then its wall clock for the renew time.
        renew_time = renew_started + wall_read_delay + holder_skew
        renewed = build_renewal(dataclasses.replace(held(), duration_ms=duration_ms), now_ms=renew_time)

        deadline = safe_serving_deadline_ms(renew_started, duration_ms=duration_ms, clock_skew_margin_ms=margin)

        last_serving_moment = deadline - 1
        assert not is_expired(renewed, last_serving_moment + judge_skew)

    def test_skew_beyond_the_margin_breaks_the_guarantee(self) -> None:
        # Why the margin exists: a judge whose clock runs ahead by more than the margin sees
        # the lease expire while the holder still serves.
        renewed = build_takeover(held(), new_holder="server-1", now_ms=50_000, duration_ms=DURATION_MS)
        deadline = safe_serving_deadline_ms(50_000, duration_ms=DURATION_MS, clock_skew_margin_ms=1_000)
        assert not is_expired(renewed, deadline - 1 + 1_000)
        assert is_expired(renewed, deadline - 1 + 1_001)

    @pytest.mark.parametrize(
        ("duration_ms", "margin_ms"), [(0, 0), (-5, 0), (1_000, -1), (1_000, 1_000), (1_000, 5_000)]
    )
    def test_margin_must_leave_part_of_the_lease(self, duration_ms: int, margin_ms: int) -> None:
        with pytest.raises(ValueError, match="must be"):
            safe_serving_deadline_ms(0, duration_ms=duration_ms, clock_skew_margin_ms=margin_ms)


class TestQueueCreations:
    """A lease names which creation of its queue it is for, so a replica of a deleted
    namesake, still running until the map reaches it, neither leads nor follows under it."""

    def test_a_new_shards_lease_names_its_queues_creation_and_keeps_it_through_takeovers(self) -> None:
        shard = ShardId("orders", 0)
        fresh = lease_for_new_shard(
            None, shard=shard, replicas=["s1", "s2"], now_ms=T0, duration_ms=DURATION_MS, queue_uid="c-1"
        )
        assert not for_another_creation(fresh, "c-1")
        assert for_another_creation(fresh, "c-0")
        moved = build_takeover(fresh, new_holder="s2", now_ms=T0 + 1, duration_ms=DURATION_MS)
        assert for_another_creation(moved, "c-0")
        assert not for_another_creation(moved, "c-1")

    def test_a_namesakes_left_lease_moves_to_the_new_creation_in_the_next_epoch(self) -> None:
        shard = ShardId("orders", 0)
        old = dataclasses.replace(
            lease_for_new_shard(
                None, shard=shard, replicas=["s1", "s2"], now_ms=T0, duration_ms=DURATION_MS, queue_uid="c-1"
            ),
            version="3",
            transitions=7,
        )
        again = lease_for_new_shard(
            old, shard=shard, replicas=["s2", "s1"], now_ms=T0 + 5, duration_ms=DURATION_MS, queue_uid="c-2"
        )
        assert again.transitions == 8
        assert again.holder == "s2"
        assert for_another_creation(again, "c-1")
        assert not for_another_creation(again, "c-2")

    def test_a_lease_or_a_replica_that_names_no_creation_is_no_other_creation(self) -> None:
        unnamed = held()
        assert not for_another_creation(unnamed, "c-1")
        named = lease_for_new_shard(
            None, shard=ShardId("orders", 0), replicas=["s1"], now_ms=T0, duration_ms=DURATION_MS, queue_uid="c-1"
        )
        assert not for_another_creation(named, "")


class TestEpochRaise:
    """A holder whose replicas have seen later epochs than its lease (the Leases were made
    anew) moves its lease above them, as a takeover by itself would."""

    def test_the_raise_opens_an_epoch_above_the_one_seen_and_keeps_the_rest(self) -> None:
        lease = held(transitions=2)
        raised = build_epoch_raise(lease, above=9, now_ms=T0 + 5)
        assert raised.transitions == 10
        assert (raised.holder, raised.version, raised.annotations) == (lease.holder, "17", lease.annotations)
        assert raised.renew_time_ms == raised.acquire_time_ms == T0 + 5
        assert raised.annotations is not lease.annotations

    def test_an_epoch_equal_to_the_leases_opens_the_next(self) -> None:
        assert build_epoch_raise(held(transitions=4), above=4, now_ms=T0).transitions == 5

    def test_nothing_below_the_lease_a_free_lease_or_past_the_limit_is_raised(self) -> None:
        with pytest.raises(ValueError, match="below"):
            build_epoch_raise(held(transitions=4), above=3, now_ms=T0)
        with pytest.raises(ValueError, match="no holder"):
            build_epoch_raise(held(holder=""), above=9, now_ms=T0)
        with pytest.raises(ValueError, match="limit"):
            build_epoch_raise(held(), above=EPOCH_LIMIT, now_ms=T0)
        assert build_epoch_raise(held(), above=EPOCH_LIMIT - 1, now_ms=T0).transitions == EPOCH_LIMIT
