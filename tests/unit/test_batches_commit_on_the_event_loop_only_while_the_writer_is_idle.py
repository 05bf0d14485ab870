"""A batch runs on the event loop when its shard's writer thread has nothing to do, and
on the writer thread otherwise; either way the requests of one loop turn share one
transaction, answers come after the commit, and exclusive work keeps its order.

These environments do not commit ahead (replicated shards' do not, nor any with
--no-commit-ahead); a batch committed ahead always runs on the writer thread
(tests/unit/test_a_batch_committed_ahead_answers_before_lmdb_commits.py).
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
import threading
import time
from collections.abc import Iterator

import pytest

from shard_server.domain.context import ShardContext
from shard_server.runtime.committing import CommitReport, GroupCommitter, Work, WriterThreads
from shard_server.storage import keys
from shard_server.storage.lmdb_store import LmdbShardTransaction, ShardEnvironment
from shardq.queues import QueueConfig

CONFIG = QueueConfig(name="orders", shards=2)
KEY = b"written"


@pytest.fixture
def environments(tmp_path: pathlib.Path) -> Iterator[list[ShardEnvironment]]:
    opened = [
        ShardEnvironment(tmp_path / f"shard-{index}", queue=CONFIG.name, shard=index, map_size=1 << 26)
        for index in range(CONFIG.shards)
    ]
    yield opened
    for environment in opened:
        environment.close()


def committers(
    environments: list[ShardEnvironment], writers: WriterThreads, reports: list[CommitReport]
) -> list[GroupCommitter]:
    # One writer thread for both shards: the server's default.
    thread = writers.assign()
    return [
        GroupCommitter(
            environment,
            functools.partial(ShardContext, CONFIG, index, 1),
            thread=thread,
            on_commit=reports.append,
        )
        for index, environment in enumerate(environments)
    ]


def write_marker(environment: ShardEnvironment, value: bytes) -> Work[int]:
    """Work that stores `value` and answers the id of the thread it ran on."""

    def work(tx: LmdbShardTransaction, context: ShardContext, now: int) -> int:
        tx.txn.put(KEY, value, db=environment.dbs[keys.DB_META])
        return threading.get_ident()

    return work


def stored(environment: ShardEnvironment) -> bytes | None:
    with environment.read() as tx:
        value = tx.txn.get(KEY, db=environment.dbs[keys.DB_META])
    return None if value is None else bytes(value)


def test_a_lone_request_commits_on_the_event_loop_and_answers_after_the_commit(
    environments: list[ShardEnvironment],
) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        ran_on = await first.submit(write_marker(environments[0], b"one"))
        assert ran_on == threading.get_ident()
        assert stored(environments[0]) == b"one"  # committed before the answer
        assert [report.requests for report in reports] == [1]
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_requests_of_one_loop_turn_share_one_transaction(environments: list[ShardEnvironment]) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        futures = [first.enqueue(write_marker(environments[0], b"%d" % number)) for number in range(3)]
        assert first.collecting  # the batch has not taken its requests yet
        await asyncio.gather(*futures)
        assert not first.collecting
        assert [report.requests for report in reports] == [3]
        assert stored(environments[0]) == b"2"
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_request_waits_for_the_writer_thread_while_it_is_busy(environments: list[ShardEnvironment]) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, second = committers(environments, writers, reports)
        release = threading.Event()
        # The shared writer thread is busy with the first shard's exclusive work ...
        exclusive = asyncio.ensure_future(first.run_exclusive(lambda: release.wait(timeout=10)))
        await asyncio.sleep(0)
        # ... so the second shard's batch goes to that thread rather than the event loop,
        # whose fsyncs would otherwise run while the thread stands idle.
        answer = second.enqueue(write_marker(environments[1], b"two"))
        await asyncio.sleep(0.05)
        assert not answer.done()  # queued behind the exclusive work on the writer thread
        release.set()
        ran_on = await answer
        assert await exclusive is True
        assert ran_on != threading.get_ident()
        assert stored(environments[1]) == b"two"
        await first.close()
        await second.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_exclusive_work_runs_after_a_batch_due_on_the_event_loop(environments: list[ShardEnvironment]) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        order: list[str] = []

        def batch_work(tx: LmdbShardTransaction, context: ShardContext, now: int) -> None:
            order.append("batch")

        def exclusive_work() -> None:
            order.append("exclusive")

        queued = first.enqueue(batch_work)
        await asyncio.gather(first.run_exclusive(exclusive_work), queued)
        assert order == ["batch", "exclusive"]
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_with_commits_on_the_loop_turned_off_every_batch_runs_on_the_writer_thread(
    environments: list[ShardEnvironment],
) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        ran_on = await first.submit(write_marker(environments[0], b"one"))
        assert ran_on != threading.get_ident()
        assert stored(environments[0]) == b"one"
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_batch_answering_before_its_commit_runs_on_the_writer_thread(
    environments: list[ShardEnvironment],
) -> None:
    """A receive's answer must not wait for the fsync, as it would on the event loop."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        ran_on = await first.submit(write_marker(environments[0], b"claim"), answer_before_commit=lambda _: 0)
        assert ran_on != threading.get_ident()
        await first.close()
        assert stored(environments[0]) == b"claim"
        writers.shutdown()

    asyncio.run(scenario())


def test_shards_written_in_one_loop_turn_all_commit_on_the_writer_thread(
    environments: list[ShardEnvironment],
) -> None:
    """The loop stays free to answer the first shard's batch while the second's commits."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, second = committers(environments, writers, reports)
        answers = [
            first.enqueue(write_marker(environments[0], b"one")),
            second.enqueue(write_marker(environments[1], b"two")),
        ]
        ran_on = await asyncio.gather(*answers)
        assert threading.get_ident() not in ran_on
        assert (stored(environments[0]), stored(environments[1])) == (b"one", b"two")
        await first.close()
        await second.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_batch_goes_to_the_writer_while_other_calls_are_in_progress(environments: list[ShardEnvironment]) -> None:
    """Calls being received or answered are work for the loop: the fsync then runs elsewhere."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        with writers.calls:  # this call alone: its batch runs on the loop
            started = time.monotonic()
            alone = await first.submit(write_marker(environments[0], b"one"))
            took = time.monotonic() - started
        with writers.calls, writers.calls:  # another call in progress besides this one
            accompanied = await first.submit(write_marker(environments[0], b"two"))
            # Longer apart than the commit on the loop took: that rule is tested on its own.
            await asyncio.sleep(took)
            with writers.calls.paused():  # ... unless the other only waits in a long poll
                beside_a_long_poll = await first.submit(write_marker(environments[0], b"three"))
        assert alone == threading.get_ident()
        assert accompanied != threading.get_ident()
        assert beside_a_long_poll == threading.get_ident()
        assert writers.calls.count == 0
        assert stored(environments[0]) == b"three"
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_requests_queued_during_a_commit_form_a_batch_on_the_writer_thread(
    environments: list[ShardEnvironment],
) -> None:
    """Requests arriving while a batch commits mean load: their batch does not block the loop."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)
        started, release = threading.Event(), threading.Event()

        def slow_claim(tx: LmdbShardTransaction, context: ShardContext, now: int) -> int:
            started.set()
            release.wait(timeout=10)
            return threading.get_ident()

        # Answering before commit puts the first batch on the writer thread.
        running = first.enqueue(slow_claim, answer_before_commit=lambda _: 0)
        assert await asyncio.to_thread(started.wait, 10)
        queued_meanwhile = first.enqueue(write_marker(environments[0], b"two"))
        release.set()
        assert await running != threading.get_ident()
        assert await queued_meanwhile != threading.get_ident()
        assert [report.requests for report in reports] == [1, 1]
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_batch_right_after_a_long_one_on_the_loop_goes_to_the_writer(
    environments: list[ShardEnvironment],
) -> None:
    """Calls gRPC received while the loop was blocked in a commit are counted nowhere: a
    batch starting sooner after it than it took goes to the writer thread."""

    async def scenario() -> None:
        writers = WriterThreads(1)
        reports: list[CommitReport] = []
        first, _ = committers(environments, writers, reports)

        def slow(tx: LmdbShardTransaction, context: ShardContext, now: int) -> int:
            time.sleep(0.2)  # deliberately blocks: stands for a slow fsync
            return threading.get_ident()

        assert await first.submit(slow) == threading.get_ident()
        assert await first.submit(write_marker(environments[0], b"next")) != threading.get_ident()
        await first.close()
        writers.shutdown()

    asyncio.run(scenario())
