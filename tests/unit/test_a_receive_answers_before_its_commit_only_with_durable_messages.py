"""A receive may answer before its claim commits (a lost claim is only a redelivery),
but never with a message whose send is not durable yet: a crash before that commit
would leave a consumer holding a message the queue never stored, one that cannot
come back if the consumer leaves it undeleted. CI caught exactly that: three
received, undeleted messages gone after a SIGKILL.

The crash is a commit that fails after the batch's work ran (the transaction is
aborted, as a SIGKILL before the commit leaves it), injected at that exact instant
because a real kill cannot be timed to it; the store, the work and the committer
are the real ones. Replication is held by an event standing for a slow follower.
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from shard_server.domain import receiving
from shard_server.domain.context import ShardContext
from shard_server.runtime.committing import CommitReport, GroupCommitter, WriterThreads
from shard_server.storage.lmdb_store import LmdbShardTransaction, OpenBatch, ShardEnvironment
from shardq.errors import Reason, ShardqError
from shardq.queues import QueueConfig
from tests.support.shard_work import send, stored_bodies

CONFIG = QueueConfig(name="orders", shards=1)
T = TypeVar("T")


class CrashingEnvironment(ShardEnvironment):
    """A shard environment whose next commit can be lost after its work ran."""

    lose_next_commit = False

    def begin_batch(
        self,
        work: Callable[[LmdbShardTransaction], T],
        *,
        epoch: int,
        at_ms: int,
        write_ahead_if: Callable[[int], bool] | None = None,
    ) -> OpenBatch[T]:
        def then_crash(tx: LmdbShardTransaction) -> T:
            result = work(tx)
            if self.lose_next_commit:
                self.lose_next_commit = False
                raise RuntimeError("the process died before this commit")  # aborts the transaction
            return result

        return super().begin_batch(then_crash, epoch=epoch, at_ms=at_ms, write_ahead_if=write_ahead_if)


@pytest.fixture
def environment(tmp_path: pathlib.Path) -> Iterator[CrashingEnvironment]:
    opened = CrashingEnvironment(tmp_path / "shard-0", queue=CONFIG.name, shard=0, map_size=1 << 26)
    yield opened
    opened.close()


def claim(tx: LmdbShardTransaction, context: ShardContext, now: int) -> receiving.ReceiveOutcome:
    return receiving.receive_messages(tx, context, max_messages=10, visibility_timeout_ms=30_000, now_ms=now)


def bodies(outcome: receiving.ReceiveOutcome) -> list[bytes]:
    return [message.record.body for message in outcome.claimed]


def committer(environment: ShardEnvironment, writers: WriterThreads, **replication: object) -> GroupCommitter:
    reports: list[CommitReport] = []
    return GroupCommitter(
        environment,
        functools.partial(ShardContext, CONFIG, 0, 1),
        thread=writers.assign(),
        on_commit=reports.append,
        **replication,  # type: ignore[arg-type]
    )


def test_a_claim_on_a_message_sent_in_its_own_batch_answers_with_the_commit(
    environment: CrashingEnvironment,
) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        shard = committer(environment, writers)
        environment.lose_next_commit = True
        sent = shard.enqueue(send(b"fresh"))
        claimed = shard.enqueue(claim, answer_before_commit=receiving.newest_seq)
        outcomes = await asyncio.gather(sent, claimed, return_exceptions=True)
        assert stored_bodies(environment) == []
        for outcome in outcomes:
            # Not the message: the commit that would have stored it never happened.
            assert isinstance(outcome, ShardqError), outcome
            assert outcome.reason is Reason.UNAVAILABLE
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_claim_on_committed_messages_still_answers_before_its_own_commit(
    environment: CrashingEnvironment,
) -> None:
    """The early answer stays where it is safe: its lost claim only means a redelivery."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        shard = committer(environment, writers)
        await shard.submit(send(b"committed"))
        environment.lose_next_commit = True
        claimed = await shard.submit(claim, answer_before_commit=receiving.newest_seq)
        assert bodies(claimed) == [b"committed"]
        # The claim was lost with its commit: the message is still there, visible again.
        assert stored_bodies(environment) == [b"committed"]
        again = await shard.submit(claim, answer_before_commit=receiving.newest_seq)
        assert bodies(again) == [b"committed"]
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_on_a_replicated_shard_a_claim_waits_for_the_send_to_replicate(
    environment: CrashingEnvironment,
) -> None:
    """Committed here but not yet on every in-sync replica: a failover could still lose it."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        followers_caught_up = asyncio.Event()

        async def replicated(index: int, epoch: int) -> None:
            await followers_caught_up.wait()

        shard = committer(environment, writers, replicated=replicated)
        sent = shard.enqueue(send(b"replicating"))
        await asyncio.sleep(0.05)  # the send's batch commits here and waits for its followers
        claimed = shard.enqueue(claim, answer_before_commit=receiving.newest_seq)
        done, _ = await asyncio.wait({sent, claimed}, timeout=0.5)
        assert not done, "answered before the send reached every in-sync replica"
        followers_caught_up.set()
        assert [outcome.error for outcome in await sent] == [None]
        assert bodies(await claimed) == [b"replicating"]

        # Once a send has replicated, a claim on it answers before its own batch has.
        assert [outcome.error for outcome in await shard.submit(send(b"replicated"))] == [None]
        followers_caught_up.clear()
        early = await asyncio.wait_for(shard.submit(claim, answer_before_commit=receiving.newest_seq), timeout=5)
        assert bodies(early) == [b"replicated"]
        followers_caught_up.set()
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())
