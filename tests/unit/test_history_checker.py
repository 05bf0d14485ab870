"""The fault-test checker on synthetic histories: each rule flags what it must, and
concurrent-but-legal histories (including ones from a simulated correct queue) pass."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pathlib
import random
from collections.abc import Sequence
from typing import Any

import pytest

from tests.faults.checking import Property, QueueSpec, Violation, check_history, format_violations
from tests.faults.history import (
    AnyOperation,
    ChangeVisibility,
    Delete,
    Delivery,
    History,
    Receive,
    Send,
    Status,
    StoredMessage,
    dump_history,
    load_history,
    status_for_reason,
)

QUEUE = "orders"
FIFO = "fifo"
DLQ = "orders-dlq"
QUEUES = (QueueSpec(QUEUE), QueueSpec(FIFO, fifo=True), QueueSpec("redriven", dead_letter_queue=DLQ), QueueSpec(DLQ))
# Wall time of t=0 in the scripts below; monotonic time is t in ns.
WALL0 = 1_700_000_000_000


class Script:
    """Builds a history from explicit [invoke, complete] times in milliseconds."""

    def __init__(self) -> None:
        self.operations: list[AnyOperation] = []
        self.final: list[StoredMessage] = []
        self._ids = itertools.count(1)
        self._seqs = itertools.count(1)

    def _common(self, t0: int, t1: int, client: str, status: Status, error: str, queue: str) -> dict[str, Any]:
        assert t0 <= t1
        return {
            "op_id": next(self._ids),
            "client": client,
            "queue": queue,
            "invoke_ns": t0 * 1_000_000,
            "complete_ns": t1 * 1_000_000,
            "invoke_wall_ms": WALL0 + t0,
            "complete_wall_ms": WALL0 + t1,
            "status": status,
            "error": error,
        }

    def send(
        self,
        t0: int,
        t1: int,
        body: str,
        *,
        message_id: str | None = None,
        status: Status = Status.OK,
        queue: str = QUEUE,
        group_id: str = "",
        dedup_id: str = "",
        duplicate: bool = False,
        client: str = "producer",
    ) -> Send:
        send = Send(
            **self._common(t0, t1, client, status, "" if status is Status.OK else "UNAVAILABLE", queue),
            body=body,
            group_id=group_id,
            dedup_id=dedup_id,
            message_id=(message_id or f"m-{body}") if status is Status.OK else "",
            duplicate=duplicate,
            shard=0,
        )
        self.operations.append(send)
        return send

    def receive(
        self,
        t0: int,
        t1: int,
        *bodies: str,
        visible_until: int | None = None,
        vt: int = 2_000,
        queue: str = QUEUE,
        epoch: int = 1,
        shard: int = 0,
        group_id: str = "",
        client: str = "consumer",
        message_ids: dict[str, str] | None = None,
        ids: Sequence[str] = (),
    ) -> list[Delivery]:
        common = self._common(t0, t1, client, Status.OK, "", queue)
        deliveries = [
            Delivery(
                message_id=ids[position] if ids else (message_ids or {}).get(body, f"m-{body}"),
                body=body,
                group_id=group_id,
                dedup_id="",
                receipt=f"receipt-{common['op_id']}-{position}",
                shard=shard,
                seq=next(self._seqs),
                epoch=epoch,
                claim_token=1,
                receive_count=1,
                visible_until_ms=WALL0 + (visible_until if visible_until is not None else t0 + vt),
            )
            for position, body in enumerate(bodies)
        ]
        self.operations.append(
            Receive(**common, max_messages=10, visibility_timeout_ms=vt, deliveries=tuple(deliveries))
        )
        return deliveries

    def failed_receive(self, t0: int, t1: int, *, queue: str = QUEUE) -> None:
        common = self._common(t0, t1, "consumer", Status.UNKNOWN, "UNAVAILABLE", queue)
        self.operations.append(Receive(**common, max_messages=10, visibility_timeout_ms=2_000))

    def delete(self, t0: int, t1: int, delivery: Delivery, *, status: Status = Status.OK, queue: str = QUEUE) -> Delete:
        error = {Status.OK: "", Status.FAILED: "STALE_RECEIPT", Status.UNKNOWN: "UNAVAILABLE"}[status]
        delete = Delete(
            **self._common(t0, t1, "consumer", status, error, queue),
            receipt=delivery.receipt,
            message_id=delivery.message_id,
        )
        self.operations.append(delete)
        return delete

    def change(
        self, t0: int, t1: int, delivery: Delivery, timeout_ms: int, *, status: Status = Status.OK, queue: str = QUEUE
    ) -> ChangeVisibility:
        error = {Status.OK: "", Status.FAILED: "RECEIPT_EXPIRED", Status.UNKNOWN: "UNAVAILABLE"}[status]
        change = ChangeVisibility(
            **self._common(t0, t1, "consumer", status, error, queue),
            receipt=delivery.receipt,
            message_id=delivery.message_id,
            visibility_timeout_ms=timeout_ms,
        )
        self.operations.append(change)
        return change

    def stored(self, body: str, *, queue: str = QUEUE) -> None:
        self.final.append(StoredMessage(queue, f"m-{body}", body))

    def check(self) -> list[Violation]:
        return check_history(self.operations, final=self.final, queues=QUEUES)


def rules(violations: list[Violation]) -> list[str]:
    return sorted(v.rule for v in violations)


def assert_clean(script: Script) -> None:
    violations = script.check()
    assert not violations, format_violations(violations)


# -- property 1: nothing acknowledged is lost -----------------------------------------------


def test_sent_received_deleted_is_clean() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a")
    s.delete(40, 50, a)
    assert_clean(s)


def test_acknowledged_send_still_stored_is_clean() -> None:
    s = Script()
    s.send(0, 10, "a")
    s.stored("a")
    assert_clean(s)


def test_send_with_unknown_outcome_may_vanish() -> None:
    s = Script()
    s.send(0, 10, "a", status=Status.UNKNOWN)
    assert_clean(s)


def test_acknowledged_send_never_received_nor_stored_is_lost() -> None:
    s = Script()
    s.send(0, 10, "a")
    s.send(0, 10, "b")
    s.stored("b")
    violations = s.check()
    assert rules(violations) == ["lost-never-received"]
    assert violations[0].message_id == "m-a"
    assert violations[0].property is Property.NOTHING_LOST


def test_received_then_gone_without_a_delete_is_lost() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a")
    s.delete(40, 50, a, status=Status.FAILED)
    assert rules(s.check()) == ["lost-after-receive"]


def test_a_delete_with_unknown_outcome_may_have_removed_it() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a")
    s.delete(40, 50, a, status=Status.UNKNOWN)
    assert_clean(s)


def test_a_dead_letter_copy_counts_as_kept() -> None:
    s = Script()
    s.send(0, 10, "a", queue="redriven")
    s.receive(20, 30, "a", queue="redriven")
    s.final.append(StoredMessage(DLQ, "dlq-copy-of-a", "a"))
    assert_clean(s)
    s.final.clear()
    assert rules(s.check()) == ["lost-after-receive"]


def test_a_body_nobody_sent_is_a_phantom() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a, ghost) = s.receive(20, 30, "a", "ghost")
    s.delete(40, 50, a)
    s.delete(40, 50, ghost)
    assert rules(s.check()) == ["phantom"]


def test_a_body_received_under_another_id_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a", message_id="m-1")
    (a,) = s.receive(20, 30, "a", message_ids={"a": "m-2"})
    s.delete(40, 50, a)
    # m-1 is also never received and not stored.
    assert rules(s.check()) == ["lost-never-received", "wrong-message-id"]


def test_one_send_call_that_stored_two_messages_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a", message_id="m-2")  # a library retry; the first attempt (m-1) was applied too
    first, second = s.receive(20, 30, "a", "a", ids=["m-1", "m-2"])
    s.delete(40, 50, first)
    s.delete(40, 50, second)
    assert rules(s.check()) == ["stored-twice"]


# -- property 2: receipts are current -----------------------------------------------------------


def test_delete_after_a_later_receive_completed_is_stale() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", client="c1")
    s.change(100, 110, first, 0)  # released: the message may be claimed again
    (second,) = s.receive(200, 210, "a", client="c2")
    s.change(220, 230, second, 1_000)  # the second claim certainly committed
    s.delete(300, 310, first)
    violations = s.check()
    assert rules(violations) == ["stale-receipt"]
    assert violations[0].op_ids[-1] == s.operations[-1].op_id


def test_a_later_unconfirmed_receive_may_have_been_a_stale_answer() -> None:
    # A deposed leader may answer a receive from its old state; that claim never
    # commits, so the first receipt can still be current.
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", client="c1")
    s.receive(200, 210, "a", client="c2", epoch=1)
    s.delete(300, 310, first)
    assert_clean(s)


def test_a_stale_receipt_rejected_is_clean() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", visible_until=40)
    (second,) = s.receive(200, 210, "a")
    s.delete(300, 310, first, status=Status.FAILED)
    s.delete(320, 330, second)
    assert_clean(s)


def test_a_receive_overlapping_the_first_does_not_make_it_stale() -> None:
    # The second receive was invoked before the first completed: it may have
    # claimed first (its lease expired at 6) and been answered late.
    s = Script()
    s.send(0, 1, "a")
    (first,) = s.receive(8, 10, "a", visible_until=2_008)
    s.receive(5, 300, "a", visible_until=6)
    s.delete(320, 330, first)
    assert_clean(s)


def test_a_later_receive_still_running_does_not_make_it_stale() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a")
    s.change(40, 50, first, 0)
    s.receive(60, 500, "a")  # completed after the delete was invoked: may have claimed after it
    s.delete(400, 410, first)
    violations = s.check()
    # The delete after a release: the checker cannot order it after the second claim.
    assert "stale-receipt" not in rules(violations)


def test_delete_after_the_deadline_is_expired() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=2_000)
    s.delete(2_100, 2_110, a)
    assert rules(s.check()) == ["expired-receipt"]


def test_delete_within_the_clock_tolerance_is_clean() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=2_000)
    s.delete(2_010, 2_020, a)
    assert_clean(s)


@pytest.mark.parametrize("extension", [Status.OK, Status.UNKNOWN])
def test_an_extension_moves_the_deadline(extension: Status) -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=2_000)
    s.change(1_500, 1_510, a, 3_000, status=extension)
    s.delete(4_000, 4_010, a)
    assert_clean(s)


def test_a_failed_extension_does_not_move_the_deadline() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=2_000)
    s.change(1_500, 1_510, a, 3_000, status=Status.FAILED)
    s.delete(4_000, 4_010, a)
    assert rules(s.check()) == ["expired-receipt"]


def test_change_visibility_after_the_deadline_is_expired() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=2_000)
    s.change(2_500, 2_510, a, 5_000)
    s.delete(3_000, 3_010, a)
    violations = s.check()
    # Only the change is flagged: once (wrongly) accepted it did extend the deadline,
    # so the delete that follows is the change's consequence, not a second fault.
    assert rules(violations) == ["expired-receipt"]
    assert violations[0].op_ids[-1] == s.operations[-2].op_id


# -- property 3: one holder ------------------------------------------------------------------


def test_two_confirmed_overlapping_leases_are_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", visible_until=2_000, client="c1")
    s.change(100, 110, first, 2_000)
    (second,) = s.receive(500, 510, "a", client="c2")
    s.delete(600, 610, second)
    violations = s.check()
    assert rules(violations) == ["two-holders"]
    assert "overlap by 90 ms" in violations[0].explanation


def test_an_unconfirmed_lease_may_have_been_a_lost_claim() -> None:
    s = Script()
    s.send(0, 10, "a")
    s.receive(20, 30, "a", visible_until=2_000, client="c1")
    (second,) = s.receive(500, 510, "a", client="c2")
    s.delete(600, 610, second)
    assert_clean(s)


def test_a_released_lease_ends_at_the_release() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", visible_until=2_000)
    s.change(100, 110, first, 0)
    (second,) = s.receive(200, 210, "a")
    s.delete(300, 310, second)
    assert_clean(s)


def test_leases_after_expiry_do_not_overlap() -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", visible_until=1_000)
    s.change(100, 110, first, 800)
    (second,) = s.receive(1_000, 1_010, "a")
    s.delete(1_100, 1_110, second)
    assert_clean(s)


@pytest.mark.parametrize(("second_at", "flagged"), [(1_980, False), (1_940, True)])
def test_overlap_tolerance(second_at: int, flagged: bool) -> None:
    s = Script()
    s.send(0, 10, "a")
    (first,) = s.receive(20, 30, "a", visible_until=2_000)
    s.change(40, 50, first, 5_000)
    (second,) = s.receive(second_at - 10, second_at, "a")
    s.delete(second_at + 100, second_at + 110, second)
    assert ("two-holders" in rules(s.check())) is flagged


# -- property 4: nothing from a fenced leader ------------------------------------------------


def test_two_acknowledged_deletes_are_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a")
    s.delete(40, 50, a)
    s.delete(60, 70, a)
    assert rules(s.check()) == ["deleted-twice"]


def test_a_delivery_after_an_acknowledged_delete_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=100)
    s.delete(40, 50, a)
    (again,) = s.receive(200, 210, "a")
    s.change(220, 230, again, 1_000)
    assert rules(s.check()) == ["delivered-after-delete"]


def test_an_unconfirmed_delivery_after_a_delete_may_be_a_stale_answer() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=100)
    s.delete(40, 50, a)
    (again,) = s.receive(200, 210, "a")
    s.delete(220, 230, again, status=Status.FAILED)
    assert_clean(s)


def test_a_delivery_concurrent_with_the_delete_is_not_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a", visible_until=35)
    s.delete(34, 50, a)
    s.receive(45, 60, "a")  # may have been decided at 36, before the delete (which then... )
    assert "delivered-after-delete" not in rules(s.check())


def test_a_deleted_message_still_stored_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    (a,) = s.receive(20, 30, "a")
    s.delete(40, 50, a)
    s.stored("a")
    assert rules(s.check()) == ["deleted-but-stored"]


def test_an_epoch_going_back_on_a_shard_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a")
    s.send(0, 10, "b")
    (a,) = s.receive(20, 30, "a", epoch=3)
    (b,) = s.receive(40, 50, "b", epoch=2)
    s.delete(60, 70, a)
    s.delete(60, 70, b)
    assert rules(s.check()) == ["epoch-went-back"]


@pytest.mark.parametrize(("b_invoked", "b_shard", "b_confirmed"), [(25, 0, True), (40, 1, True), (40, 0, False)])
def test_older_epochs_on_concurrent_receives_other_shards_or_unconfirmed_claims_are_fine(
    b_invoked: int, b_shard: int, b_confirmed: bool
) -> None:
    s = Script()
    s.send(0, 10, "a")
    s.send(0, 10, "b")
    (a,) = s.receive(20, 30, "a", epoch=3)
    (b,) = s.receive(b_invoked, 50, "b", epoch=2, shard=b_shard)
    s.delete(60, 70, a)
    if b_confirmed:
        s.delete(60, 70, b)
    else:
        s.stored("b")
    assert_clean(s)


# -- property 5: dedup and FIFO order ------------------------------------------------------


def test_dedup_repeats_return_the_original_id() -> None:
    s = Script()
    s.send(0, 10, "a", dedup_id="d")
    s.send(20, 30, "a", dedup_id="d", message_id="m-a", duplicate=True)
    s.send(40, 50, "a", dedup_id="d", status=Status.UNKNOWN)
    s.stored("a")
    assert_clean(s)


def test_dedup_split_across_failover_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a", dedup_id="d")
    s.send(20, 30, "a", dedup_id="d", message_id="m-a2")
    s.stored("a")
    s.final.append(StoredMessage(QUEUE, "m-a2", "a"))
    assert rules(s.check()) == ["dedup-split"]


def test_fifo_in_order_is_clean() -> None:
    s = Script()
    s.send(0, 10, "a", queue=FIFO, group_id="g")
    s.send(20, 30, "b", queue=FIFO, group_id="g")
    (a,) = s.receive(40, 50, "a", queue=FIFO, group_id="g")
    s.delete(60, 70, a, queue=FIFO)
    (b,) = s.receive(65, 80, "b", queue=FIFO, group_id="g")  # completed after the delete began
    s.delete(90, 100, b, queue=FIFO)
    assert_clean(s)


def test_fifo_successor_before_head_removed_is_flagged() -> None:
    s = Script()
    s.send(0, 10, "a", queue=FIFO, group_id="g")
    s.send(20, 30, "b", queue=FIFO, group_id="g")
    (b,) = s.receive(40, 50, "b", queue=FIFO, group_id="g")
    s.delete(60, 70, b, queue=FIFO)
    (a,) = s.receive(80, 90, "a", queue=FIFO, group_id="g")
    s.delete(100, 110, a, queue=FIFO)
    violations = s.check()
    assert rules(violations) == ["fifo-order"]
    assert violations[0].message_id == "m-b"


def test_fifo_concurrent_sends_have_no_order() -> None:
    s = Script()
    s.send(0, 30, "a", queue=FIFO, group_id="g")
    s.send(10, 20, "b", queue=FIFO, group_id="g")
    (b,) = s.receive(40, 50, "b", queue=FIFO, group_id="g")
    s.delete(60, 70, b, queue=FIFO)
    (a,) = s.receive(80, 90, "a", queue=FIFO, group_id="g")
    s.delete(100, 110, a, queue=FIFO)
    assert_clean(s)


def test_fifo_two_of_a_group_in_flight_is_flagged() -> None:
    s = Script()
    s.send(0, 30, "a", queue=FIFO, group_id="g")
    s.send(10, 20, "b", queue=FIFO, group_id="g")
    (a,) = s.receive(40, 50, "a", queue=FIFO, group_id="g", visible_until=2_040)
    s.change(60, 70, a, 2_000, queue=FIFO)
    (b,) = s.receive(100, 110, "b", queue=FIFO, group_id="g")
    s.delete(200, 210, b, queue=FIFO)
    s.delete(300, 310, a, queue=FIFO)
    assert rules(s.check()) == ["group-two-in-flight"]


def test_different_groups_and_standard_queues_may_overlap() -> None:
    s = Script()
    for queue, group_a, group_b in ((FIFO, "g1", "g2"), (QUEUE, "", "")):
        s.send(0, 10, f"{queue}-a", queue=queue, group_id=group_a)
        s.send(20, 30, f"{queue}-b", queue=queue, group_id=group_b)
        (b,) = s.receive(40, 50, f"{queue}-b", queue=queue, group_id=group_b)
        (a,) = s.receive(40, 50, f"{queue}-a", queue=queue, group_id=group_a)
        s.delete(60, 70, b, queue=queue)
        s.delete(60, 70, a, queue=queue)
    assert_clean(s)


# -- recording ---------------------------------------------------------------------------------


def test_history_round_trips_through_json_lines(tmp_path: pathlib.Path) -> None:
    s = Script()
    s.send(0, 10, "a", dedup_id="d")
    (a,) = s.receive(20, 30, "a")
    s.change(35, 36, a, 100)
    s.delete(40, 50, a, status=Status.UNKNOWN)
    s.failed_receive(60, 70)
    s.stored("a")
    path = tmp_path / "history.jsonl"
    dump_history(s.operations, path, final=s.final)
    operations, final = load_history(path)
    assert operations == s.operations
    assert final == s.final


def test_recorder_numbers_operations_and_orders_timestamps() -> None:
    history = History()
    first = history.invoke("c1")
    second = history.invoke("c2")
    common = History.completion(first)
    history.append(Send(**common, queue=QUEUE, status=Status.OK, body="a", message_id="m-a"))
    (recorded,) = history.operations()
    assert (first.op_id, second.op_id) == (1, 2)
    assert recorded.invoke_ns <= recorded.complete_ns
    assert recorded.invoke_wall_ms <= recorded.complete_wall_ms


@pytest.mark.parametrize(
    ("reason", "status"),
    [("STALE_RECEIPT", Status.FAILED), ("RECEIPT_EXPIRED", Status.FAILED), ("NOT_LEADER", Status.UNKNOWN)],
)
def test_only_definite_refusals_count_as_failed(reason: str, status: Status) -> None:
    assert status_for_reason(reason) is status
    assert status_for_reason("TIMEOUT") is Status.UNKNOWN


# -- a correct queue, simulated under random concurrency, never trips the checker ------------


@dataclasses.dataclass
class _Claim:
    token: int
    deadline: int


class ReferenceQueue:
    """One FIFO-capable queue with SQS semantics; `now` is passed in."""

    def __init__(self) -> None:
        self.order: list[str] = []  # send order, for group heads
        self.groups: dict[str, str] = {}
        self.visible_at: dict[str, int] = {}
        self.claims: dict[str, _Claim] = {}
        self.tokens = itertools.count(1)

    def copy(self) -> ReferenceQueue:
        """The same state; claims made on the copy never reach this queue (tokens stay unique)."""
        clone = copy.copy(self)
        clone.order = list(self.order)
        clone.groups = dict(self.groups)
        clone.visible_at = dict(self.visible_at)
        clone.claims = dict(self.claims)
        return clone

    def send(self, message_id: str, group: str) -> None:
        self.order.append(message_id)
        self.groups[message_id] = group
        self.visible_at[message_id] = 0

    def _group_busy(self, group: str, now: int, before: str) -> bool:
        for other in self.order:
            if other == before:
                return False
            if self.groups[other] == group:
                return True
        return False

    def receive(self, now: int, vt: int, limit: int, *, lose: bool = False) -> list[tuple[str, int, int]]:
        """Claim up to `limit` eligible messages; `lose`: answer, but forget the claims."""
        taken: list[tuple[str, int, int]] = []
        for message_id in list(self.order):
            if len(taken) == limit:
                break
            group = self.groups[message_id]
            if self.visible_at[message_id] > now:
                continue
            if group and (
                self._group_busy(group, now, message_id) or any(self.groups[m] == group for m, _, _ in taken)
            ):
                continue
            token = next(self.tokens)
            taken.append((message_id, token, now + vt))
            if not lose:
                self.visible_at[message_id] = now + vt
                self.claims[message_id] = _Claim(token, now + vt)
        return taken

    def current(self, message_id: str, token: int, now: int) -> bool:
        claim = self.claims.get(message_id)
        return message_id in self.visible_at and claim is not None and claim.token == token and now < claim.deadline

    def delete(self, message_id: str, token: int, now: int) -> bool:
        if not self.current(message_id, token, now):
            return False
        self.order.remove(message_id)
        del self.visible_at[message_id]
        return True

    def change(self, message_id: str, token: int, now: int, timeout: int) -> bool:
        if not self.current(message_id, token, now):
            return False
        self.visible_at[message_id] = now + timeout
        self.claims[message_id] = _Claim(token, now + timeout)
        return True


def simulate(
    seed: int, *, queue: str, fifo: bool, reference: ReferenceQueue | None = None
) -> tuple[list[AnyOperation], list[StoredMessage]]:
    """Clients issue operations; each takes effect at a random instant inside its
    [invoke, complete] window, applied to the reference queue in effect order.

    Some outcomes are lost the way failover loses them: an UNKNOWN operation took
    effect or not, and a receive may be answered although its claim was lost
    (a leader answered before commit and died; at-least-once allows it).
    """
    rng = random.Random(seed)
    reference = reference or ReferenceQueue()
    operations: list[AnyOperation] = []
    ids = itertools.count(1)
    bodies: dict[str, str] = {}
    # Deliveries handed to consumers, with the time their receive completed: a
    # consumer can use a receipt only after it has been answered.
    held: list[tuple[Delivery, int]] = []
    pending: list[_Pending] = []
    past = [reference.copy()]
    now = 0
    sent = 0
    for _ in range(400):
        now += rng.randint(0, 15)
        invoke = now
        effect = invoke + rng.randint(0, 40)
        complete = effect + rng.randint(0, 40)
        fate = rng.choices(["ok", "unknown-applied", "unknown-dropped", "claim-lost", "stale-read"], [80, 5, 5, 5, 5])[
            0
        ]
        choice = rng.random()
        if choice < 0.3 and sent < 80:
            body = f"b{sent}"
            sent += 1
            group = f"g{sent % 3}" if fifo else ""
            pending.append(_Pending(effect, invoke, complete, fate, "send", body=body, group=group))
        elif choice < 0.6:
            pending.append(_Pending(effect, invoke, complete, fate, "receive", timeout=rng.choice([40, 150, 400])))
        elif known := [i for i, (_, answered) in enumerate(held) if answered <= invoke]:
            delivery, _ = held.pop(rng.choice(known))
            if rng.random() < 0.7:
                pending.append(_Pending(effect, invoke, complete, fate, "delete", delivery=delivery))
            else:
                timeout = rng.choice([0, 50, 150])
                pending.append(_Pending(effect, invoke, complete, fate, "change", delivery=delivery, timeout=timeout))
                if timeout:
                    held.append((delivery, complete))
        # Apply everything whose effect instant has come, in effect order; answers
        # reach consumers (`held`) when the receive completes.
        pending.sort(key=lambda p: p.effect)
        while pending and pending[0].effect <= now:
            item = pending.pop(0)
            # A stale read: a deposed leader answers from the state of a few operations ago.
            stale = item.fate == "stale-read" and item.kind == "receive"
            answering = rng.choice(past[-10:]).copy() if stale else reference
            operations.append(_apply(answering, item, next(ids), bodies, held, queue))
            past.append(reference.copy())
    for item in sorted(pending, key=lambda p: p.effect):
        operations.append(_apply(reference, item, next(ids), bodies, held, queue))
    final = [StoredMessage(queue, m, bodies[m], reference.groups[m]) for m in reference.order]
    return operations, final


@dataclasses.dataclass(frozen=True)
class _Pending:
    effect: int
    invoke: int
    complete: int
    fate: str
    kind: str
    body: str = ""
    group: str = ""
    timeout: int = 0
    delivery: Delivery | None = None


def _apply(
    reference: ReferenceQueue,
    item: _Pending,
    op_id: int,
    bodies: dict[str, str],
    held: list[tuple[Delivery, int]],
    queue: str,
) -> AnyOperation:
    unknown = item.fate.startswith("unknown")
    status = Status.UNKNOWN if unknown else Status.OK
    common: dict[str, Any] = {
        "op_id": op_id,
        "client": f"c{item.invoke % 5}",
        "queue": queue,
        "invoke_ns": item.invoke * 1_000_000,
        "complete_ns": item.complete * 1_000_000,
        "invoke_wall_ms": item.invoke,
        "complete_wall_ms": item.complete,
        "error": "UNAVAILABLE" if unknown else "",
    }
    applied = item.fate != "unknown-dropped"
    if item.kind == "send":
        message_id = f"m-{item.body}"
        if applied:
            reference.send(message_id, item.group)
            bodies[message_id] = item.body
        return Send(
            **common,
            status=status,
            body=item.body,
            group_id=item.group,
            message_id="" if unknown else message_id,
        )
    if item.kind == "receive":
        claimed = reference.receive(item.effect, item.timeout, 3, lose=item.fate == "claim-lost") if applied else []
        deliveries = tuple(
            Delivery(
                message_id=message_id,
                body=bodies[message_id],
                group_id=reference.groups[message_id],
                dedup_id="",
                receipt=f"{message_id}/{token}",
                shard=0,
                seq=0,
                epoch=1,
                claim_token=token,
                receive_count=1,
                visible_until_ms=deadline,
            )
            for message_id, token, deadline in claimed
        )
        if unknown:
            deliveries = ()
        held.extend((d, item.complete) for d in deliveries)
        return Receive(
            **common, status=status, max_messages=3, visibility_timeout_ms=item.timeout, deliveries=deliveries
        )
    delivery = item.delivery
    assert delivery is not None
    if item.kind == "delete":
        ok = applied and reference.delete(delivery.message_id, delivery.claim_token, item.effect)
    else:
        ok = applied and reference.change(delivery.message_id, delivery.claim_token, item.effect, item.timeout)
    if not ok and not unknown:
        common["error"] = "STALE_RECEIPT"
        status = Status.FAILED
    if item.kind == "delete":
        return Delete(**common, status=status, receipt=delivery.receipt, message_id=delivery.message_id)
    return ChangeVisibility(
        **common,
        status=status,
        receipt=delivery.receipt,
        message_id=delivery.message_id,
        visibility_timeout_ms=item.timeout,
    )


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fifo", [False, True])
def test_a_correct_queue_under_random_concurrency_passes(seed: int, fifo: bool) -> None:
    queue = FIFO if fifo else QUEUE
    operations, final = simulate(seed, queue=queue, fifo=fifo)
    assert sum(isinstance(o, Delete) and o.ok for o in operations) > 5, "the simulation should exercise deletes"
    violations = check_history(operations, final=final, queues=QUEUES, tolerance_ms=0)
    assert not violations, format_violations(violations)


class AcceptsAnyReceipt(ReferenceQueue):
    def current(self, message_id: str, token: int, now: int) -> bool:
        return message_id in self.visible_at


class IgnoresVisibility(ReferenceQueue):
    """Claims in-flight messages too, and honours every claim's receipt."""

    def receive(self, now: int, vt: int, limit: int, *, lose: bool = False) -> list[tuple[str, int, int]]:
        saved = dict(self.visible_at)
        self.visible_at = dict.fromkeys(self.visible_at, 0)
        taken = super().receive(now, vt, limit, lose=lose)
        claimed = {m for m, _, _ in taken}
        for message_id, visible_at in saved.items():
            if message_id not in claimed:
                self.visible_at[message_id] = visible_at
        return taken

    def current(self, message_id: str, token: int, now: int) -> bool:
        return message_id in self.visible_at


class ForgetsDeletes(ReferenceQueue):
    def delete(self, message_id: str, token: int, now: int) -> bool:
        return self.current(message_id, token, now)


class LosesSends(ReferenceQueue):
    def send(self, message_id: str, group: str) -> None:
        super().send(message_id, group)
        if len(self.order) % 10 == 0:
            self.order.remove(message_id)
            del self.visible_at[message_id]


class IgnoresGroups(ReferenceQueue):
    def _group_busy(self, group: str, now: int, before: str) -> bool:
        return False


@pytest.mark.parametrize(
    ("broken", "fifo", "expected"),
    [
        (AcceptsAnyReceipt, False, {"stale-receipt", "expired-receipt"}),
        (IgnoresVisibility, False, {"two-holders"}),
        (ForgetsDeletes, False, {"delivered-after-delete", "deleted-but-stored", "deleted-twice"}),
        (LosesSends, False, {"lost-never-received"}),
        (IgnoresGroups, True, {"fifo-order", "group-two-in-flight"}),
    ],
)
def test_the_simulation_catches_a_broken_queue(broken: type[ReferenceQueue], fifo: bool, expected: set[str]) -> None:
    """The clean simulations above mean something only if broken queues fail them."""
    flagged: set[str] = set()
    for seed in range(40):
        operations, final = simulate(seed, queue=FIFO if fifo else QUEUE, fifo=fifo, reference=broken())
        flagged.update(v.rule for v in check_history(operations, final=final, queues=QUEUES, tolerance_ms=0))
    assert expected <= flagged, flagged
