"""Model-based test: random operation sequences against the domain (on the in-memory
store) and against a plain reference queue written independently; every answer must
match, and the invariants of DESIGN §3 are checked after every step."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shard_server.domain import acknowledging, housekeeping, receiving, sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.storage.memory import MemoryShardStore
from shardq.errors import QueueFull, Reason
from shardq.queues import QueueConfig
from shardq.receipts import Receipt

CONFIG = QueueConfig(
    name="orders",
    visibility_timeout_ms=100,
    retention_ms=10_000,
    dedup_window_ms=300,
    dead_letter_queue="dlq",
    max_receive_count=3,
    max_depth=12,
    nack_backoff_base_ms=10,
    nack_backoff_max_ms=40,
    priority_lanes=3,
)


@dataclasses.dataclass
class RefMessage:
    seq: int
    sent_at: int
    visible_at: int
    receive_count: int = 0
    token: int = 0
    claimed: bool = False
    dead: bool = False
    priority: int = 0


class ReferenceQueue:
    """The rules stated as plainly as possible: lists, linear scans, no indexes."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self.messages: dict[int, RefMessage] = {}
        self.dedup: dict[str, tuple[int, int]] = {}  # id -> (seq, expires)
        self.last_seq = 0

    def send(self, dedup_id: str, delay: int, now: int, priority: int) -> tuple[int, bool]:
        if dedup_id in self.dedup and self.dedup[dedup_id][1] > now:
            return self.dedup[dedup_id][0], True
        self.last_seq += 1
        # Claim tokens count up from the send's millisecond times 65,536.
        self.messages[self.last_seq] = RefMessage(
            self.last_seq, now, now + delay, token=now * 65_536, priority=priority
        )
        if dedup_id:
            self.dedup[dedup_id] = (self.last_seq, now + self.config.dedup_window_ms)
        return self.last_seq, False

    def receive(self, count: int, visibility: int, now: int) -> list[tuple[int, int]]:
        candidates = sorted(
            (m for m in self.messages.values() if not m.dead and m.visible_at <= now),
            key=lambda m: (-m.priority, m.visible_at, m.seq),  # the highest lane first
        )
        got: list[tuple[int, int]] = []
        for message in candidates:
            if len(got) >= count:
                break
            if message.receive_count >= self.config.max_receive_count:
                message.dead = True
                continue
            message.receive_count += 1
            message.token += 1
            message.claimed = True
            message.visible_at = now + visibility
            got.append((message.seq, message.token))
        return got

    def pop(self, count: int, now: int) -> list[tuple[int, int]]:
        """A receive that deletes what it receives: a receive, then those messages gone."""
        got = self.receive(count, 30, now)
        for seq, _ in got:
            del self.messages[seq]
        return got

    def check(self, seq: int, token: int, now: int) -> RefMessage | Reason:
        message = self.messages.get(seq)
        if message is None:
            return Reason.MESSAGE_NOT_FOUND
        if message.dead or not message.claimed or message.token != token:
            return Reason.STALE_RECEIPT
        if message.visible_at <= now:
            return Reason.RECEIPT_EXPIRED
        return message

    def delete(self, seq: int, token: int, now: int) -> Reason | None:
        checked = self.check(seq, token, now)
        if isinstance(checked, Reason):
            return checked
        del self.messages[seq]
        return None

    def change_visibility(self, seq: int, token: int, timeout: int, now: int) -> Reason | None:
        checked = self.check(seq, token, now)
        if isinstance(checked, Reason):
            return checked
        checked.visible_at = now + timeout
        return None

    def release(self, seq: int, token: int, now: int) -> Reason | None:
        checked = self.check(seq, token, now)
        if isinstance(checked, Reason):
            return checked
        backoff = min(
            self.config.nack_backoff_base_ms * 2 ** (checked.receive_count - 1), self.config.nack_backoff_max_ms
        )
        checked.visible_at = now + backoff
        checked.claimed = False
        return None

    def expire(self, now: int) -> int:
        old = [seq for seq, m in self.messages.items() if m.sent_at <= now - self.config.retention_ms]
        for seq in old:
            del self.messages[seq]
        return len(old)


class ShardVersusReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryShardStore()
        self.context = ShardContext(CONFIG, shard=0, epoch=1)
        self.reference = ReferenceQueue(CONFIG)
        self.now = 1_000
        self.receipts: list[Receipt] = []

    @rule(
        dedup=st.sampled_from(["", "", "a", "b"]),
        delay=st.sampled_from([0, 0, 50, 400]),
        count=st.integers(1, 3),
        priority=st.sampled_from([0, 0, 1, 2]),
    )
    def send(self, dedup: str, delay: int, count: int, priority: int) -> None:
        batch = [NewMessage(b"x", {}, "", dedup, delay, priority=priority) for _ in range(count)]
        stored = self.store.message_count()
        try:
            outcomes = sending.send_messages(self.store, self.context, batch, now_ms=self.now)
        except QueueFull:
            assert self.store.message_count() == stored, "a refused batch stored something"
            assert len(self.reference.messages) + count > 12
            return
        expected = [self.reference.send(dedup, delay, self.now, priority) for _ in batch]
        assert [(o.seq, o.duplicate) for o in outcomes] == expected

    @rule(count=st.integers(1, 4), visibility=st.sampled_from([0, 30, 100]))
    def receive(self, count: int, visibility: int) -> None:
        outcome = receiving.receive_messages(
            self.store, self.context, max_messages=count, visibility_timeout_ms=visibility, now_ms=self.now
        )
        expected = self.reference.receive(count, visibility, self.now)
        assert [(c.receipt.seq, c.receipt.claim_token) for c in outcome.claimed] == expected
        self.receipts.extend(c.receipt for c in outcome.claimed)

    @rule(count=st.integers(1, 4))
    def receive_deleting(self, count: int) -> None:
        outcome = receiving.receive_messages(
            self.store, self.context, max_messages=count, visibility_timeout_ms=30, now_ms=self.now
        )
        acknowledging.delete_claimed(self.store, self.context, outcome.claimed, now_ms=self.now)
        expected = self.reference.pop(count, self.now)
        assert [(c.receipt.seq, c.receipt.claim_token) for c in outcome.claimed] == expected
        # Kept to act on later: each must now be refused, as the reference refuses it.
        self.receipts.extend(c.receipt for c in outcome.claimed)

    @precondition(lambda self: bool(self.receipts))
    @rule(pick=st.integers(0, 1_000), action=st.sampled_from(["delete", "extend", "release"]))
    def act_on_receipt(self, pick: int, action: str) -> None:
        receipt = self.receipts[pick % len(self.receipts)]
        if action == "delete":
            got = acknowledging.delete_message(self.store, self.context, receipt, now_ms=self.now)
            want = self.reference.delete(receipt.seq, receipt.claim_token, self.now)
        elif action == "extend":
            got = acknowledging.change_visibility(
                self.store, self.context, receipt, visibility_timeout_ms=60, now_ms=self.now
            )
            want = self.reference.change_visibility(receipt.seq, receipt.claim_token, 60, self.now)
        else:
            got = acknowledging.release_message(self.store, self.context, receipt, now_ms=self.now)
            want = self.reference.release(receipt.seq, receipt.claim_token, self.now)
        assert got == want

    @rule(step=st.sampled_from([1, 20, 60, 120, 400, 5_000]))
    def advance_time(self, step: int) -> None:
        self.now += step

    @rule()
    def expire(self) -> None:
        got = housekeeping.expire_messages(self.store, self.context, now_ms=self.now, limit=1_000)
        assert got == self.reference.expire(self.now)

    @invariant()
    def same_messages_stored(self) -> None:
        assert set(self.store.records) == set(self.reference.messages)

    @invariant()
    def one_live_receipt_per_message(self) -> None:
        live: dict[int, int] = {}
        for receipt in self.receipts:
            if isinstance(acknowledging.check_receipt(self.store, self.context, receipt, now_ms=self.now), Reason):
                continue
            assert receipt.seq not in live, f"two live receipts for message {receipt.seq}"
            live[receipt.seq] = receipt.claim_token

    @invariant()
    def dead_letters_are_kept(self) -> None:
        dead = {seq for seq, m in self.reference.messages.items() if m.dead}
        assert set(self.store.dead_letter_pending(limit=10_000)) == dead


TestShardVersusReference = ShardVersusReference.TestCase
TestShardVersusReference.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
