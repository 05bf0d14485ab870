"""A standalone shard answers a batch once its log entry is durable in the commit-ahead
file, before LMDB's commit; a crash before LMDB holds the batch durably loses nothing
answered, since opening the shard applies the entries again and ends in exactly the
state the commits would have left.

LMDB's commit is held, or made to fail, by an environment that wraps the hook run just
before it: a real commit cannot be timed to stop at that instant, nor made to fail on
demand. The crash is the real on-disk state it can leave: the data file as it was up to
two batches earlier (LMDB's meta page of a commit becomes durable with the next one),
beside the commit-ahead file written for those batches. The store, the work, the files
and the committer are the real ones.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import TypeVar

import pytest

from shard_server.domain.context import ShardContext
from shard_server.domain.events import Sent
from shard_server.runtime.committing import WRITE_AHEAD_MAX_BYTES, CommitReport, GroupCommitter, WriterThreads
from shard_server.storage import commit_ahead, keys, replica_log
from shard_server.storage.codecs import decode_entry
from shard_server.storage.lmdb_store import ShardEnvironment
from shardq.errors import Reason, ShardqError
from shardq.queues import QueueConfig
from tests.support.held_commits import HeldCommitEnvironment
from tests.support.shard_work import send, stored_bodies

CONFIG = QueueConfig(name="orders", shards=1)
T = TypeVar("T")


def open_environment(directory: pathlib.Path) -> HeldCommitEnvironment:
    return HeldCommitEnvironment(directory, queue=CONFIG.name, shard=0, map_size=1 << 26, commit_ahead=True)


@pytest.fixture
def environment(tmp_path: pathlib.Path) -> Iterator[HeldCommitEnvironment]:
    opened = open_environment(tmp_path / "shard-0")
    yield opened
    opened.close()


def committer(environment: ShardEnvironment, writers: WriterThreads) -> GroupCommitter:
    reports: list[CommitReport] = []
    return GroupCommitter(
        environment, functools.partial(ShardContext, CONFIG, 0, 1), thread=writers.assign(), on_commit=reports.append
    )


async def in_lmdb(environment: ShardEnvironment, bodies: list[bytes]) -> None:
    """Wait until LMDB has committed `bodies` (a batch is answered before its commit)."""
    for _ in range(5_000):
        if stored_bodies(environment) == bodies:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"LMDB never held {bodies}")


def bodies_in(entry: bytes) -> list[bytes]:
    return [event.record.body for event in decode_entry(entry).events if isinstance(event, Sent)]


def everything_stored(environment: ShardEnvironment) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """Every key and value of every sub-database."""
    with environment.read() as tx:
        return {
            name: [(bytes(key), bytes(value)) for key, value in tx.txn.cursor(db=environment.dbs[name])]
            for name in keys.ALL_DBS
        }


def test_a_lone_send_on_the_event_loop_is_answered_before_lmdb_commits(environment: HeldCommitEnvironment) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)  # a lone request's batch runs on the event loop
        shard = committer(environment, writers)
        seen_when_answered: list[tuple[list[bytes], list[bytes], bool]] = []

        def look(_: object) -> None:
            ahead = [body for entry in environment.committed_ahead() for body in bodies_in(entry)]
            seen_when_answered.append((stored_bodies(environment), ahead, shard.answered_uncommitted))

        answer = shard.enqueue(send(b"answered ahead"))
        answer.add_done_callback(look)
        assert [sent.seq for sent in await asyncio.wait_for(answer, 5)] == [1]
        # Answered while only the commit-ahead file held it; LMDB committed it right after.
        assert seen_when_answered == [([], [b"answered ahead"], True)]
        await shard.close()
        assert stored_bodies(environment) == [b"answered ahead"]
        writers.shutdown()

    asyncio.run(scenario())


def test_a_send_on_the_writer_thread_is_answered_while_lmdb_still_commits(
    environment: HeldCommitEnvironment,
) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)
        shard = committer(environment, writers)
        hold = environment.hold_next_commit()
        outcome = await asyncio.wait_for(shard.submit(send(b"answered ahead")), 5)
        # The answer may reach this loop before the writer thread reaches LMDB's commit:
        # either way it is held there, and released only below.
        assert await asyncio.to_thread(hold.reached.wait, 5)
        assert [sent.seq for sent in outcome] == [1]
        # Answered while LMDB has not committed it: only the commit-ahead file holds it,
        # and the committer says so (receives then ask it rather than a read transaction).
        assert stored_bodies(environment) == []
        assert shard.answered_uncommitted
        written = environment.committed_ahead()
        assert len(written) == 1
        assert decode_entry(written[0]).index == 1
        assert bodies_in(written[0]) == [b"answered ahead"]
        hold.release()
        await shard.close()
        assert not shard.answered_uncommitted
        assert stored_bodies(environment) == [b"answered ahead"]
        writers.shutdown()

    asyncio.run(scenario())


def test_a_batch_too_large_for_the_file_is_answered_once_lmdb_committed_it(environment: HeldCommitEnvironment) -> None:
    async def scenario() -> None:
        writers = WriterThreads(1)
        shard = committer(environment, writers)
        large = [bytes([n]) * (300 << 10) for n in range(4)]  # 1.2 MiB of bodies, over a slot's 1 MiB
        stored_when_answered: list[list[bytes]] = []
        answer = shard.enqueue(send(*large))
        answer.add_done_callback(lambda _: stored_when_answered.append(stored_bodies(environment)))
        assert len(await asyncio.wait_for(answer, 5)) == 4
        assert stored_when_answered == [large]
        assert environment.committed_ahead() == []
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())


def test_a_crash_before_lmdb_commits_recovers_exactly_the_committed_state(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "shard-0"
    before_batch = tmp_path / "before-batch"
    before_batch.mkdir()
    environment = open_environment(directory)

    async def scenario() -> dict[bytes, list[tuple[bytes, bytes]]]:
        writers = WriterThreads(1)
        shard = committer(environment, writers)
        await shard.submit(send(b"first"))
        # The data file as the disk may hold it after the next two batches' LMDB commits:
        # the first of them has its meta page synced only by the second's sync.
        await in_lmdb(environment, [b"first"])
        await asyncio.to_thread(environment.env.copy, str(before_batch))
        await shard.submit(send(b"second", b"third"))
        await shard.submit(send(b"fourth"))
        await shard.close()
        writers.shutdown()
        return everything_stored(environment)

    committed = asyncio.run(scenario())
    environment.close()
    # The crash: LMDB's commits of the last two batches never became durable; their entries did.
    shutil.copyfile(before_batch / "data.mdb", directory / "data.mdb")
    reopened = open_environment(directory)
    try:
        assert stored_bodies(reopened) == [b"first"]
        assert replica_log.recover_committed_ahead(reopened, fifo=CONFIG.fifo) == 3
        assert stored_bodies(reopened) == [b"first", b"second", b"third", b"fourth"]
        assert everything_stored(reopened) == committed
        # Held by LMDB now: opening again applies nothing twice.
        assert replica_log.recover_committed_ahead(reopened, fifo=CONFIG.fifo) == 0
        assert everything_stored(reopened) == committed
    finally:
        reopened.close()


def test_a_record_left_beside_another_copy_of_the_data_never_applies(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "shard-0"
    before_batch = tmp_path / "before-batch"
    before_batch.mkdir()
    environment = open_environment(directory)

    async def scenario() -> None:
        writers = WriterThreads(1)
        shard = committer(environment, writers)
        await shard.submit(send(b"first"))
        await in_lmdb(environment, [b"first"])
        await asyncio.to_thread(environment.env.copy, str(before_batch))
        await shard.submit(send(b"second"))
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())
    environment.close()
    shutil.copyfile(before_batch / "data.mdb", directory / "data.mdb")
    reopened = open_environment(directory)
    try:
        reopened.renew_incarnation()  # as installing a snapshot does: another copy of the data
        assert replica_log.recover_committed_ahead(reopened, fifo=CONFIG.fifo) == 0
        assert stored_bodies(reopened) == [b"first"]
    finally:
        reopened.close()


def test_a_failed_commit_after_answering_stops_the_shard_until_reopening_recovers_it(
    tmp_path: pathlib.Path,
) -> None:
    directory = tmp_path / "shard-0"
    environment = open_environment(directory)

    async def scenario() -> None:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)
        shard = committer(environment, writers)
        await shard.submit(send(b"committed"))
        environment.fail_next_commit = True
        answered = await shard.submit(send(b"answered, then its commit failed"))
        assert [sent.seq for sent in answered] == [2]
        assert stored_bodies(environment) == [b"committed"]
        with pytest.raises(ShardqError) as refused:
            await shard.submit(send(b"would be written over the missing batch"))
        assert refused.value.reason is Reason.UNAVAILABLE
        assert "restarting the server recovers" in str(refused.value)
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())
    environment.close()
    reopened = open_environment(directory)
    try:
        assert replica_log.recover_committed_ahead(reopened, fifo=CONFIG.fifo) == 2
        assert stored_bodies(reopened) == [b"committed", b"answered, then its commit failed"]
    finally:
        reopened.close()


def test_a_torn_record_is_ignored(tmp_path: pathlib.Path) -> None:
    records = commit_ahead.CommitAheadFile(tmp_path)
    try:
        assert records.read(incarnation="a1b2c3d4e5f6") == []  # zeros: nothing written yet
        older, newer = os.urandom(3000), os.urandom(5000)
        records.write(older, index=7, incarnation="a1b2c3d4e5f6")
        records.write(newer, index=8, incarnation="a1b2c3d4e5f6")
        assert sorted(records.read(incarnation="a1b2c3d4e5f6")) == sorted([older, newer])
        assert records.read(incarnation="ffffffffffff") == []
        # The write of index 8 stopped partway: the end of its record is still old bytes.
        descriptor = os.open(tmp_path / commit_ahead.FILE_NAME, os.O_WRONLY)
        try:
            os.pwrite(descriptor, b"\0" * 1000, 4500)
        finally:
            os.close(descriptor)
        assert records.read(incarnation="a1b2c3d4e5f6") == [older]
    finally:
        records.close()
    assert (tmp_path / commit_ahead.FILE_NAME).stat().st_size == commit_ahead.CAPACITY
    assert commit_ahead.CommitAheadFile.fits(commit_ahead.SLOT_SIZE - 64)
    assert not commit_ahead.CommitAheadFile.fits(commit_ahead.SLOT_SIZE)


def test_on_a_busy_writer_thread_a_batch_with_others_behind_it_commits_the_usual_way(tmp_path: pathlib.Path) -> None:
    """Writing ahead is one more synchronous write before the batches queued behind: a
    batch is written ahead only while none waits for the thread."""
    first, second, third = (open_environment(tmp_path / f"shard-{index}") for index in range(3))

    async def scenario() -> None:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)  # the three shards share its thread
        shards = [committer(environment, writers) for environment in (first, second, third)]
        hold = first.hold_next_commit()
        answers = [shards[0].enqueue(send(b"holds the thread"))]
        assert await asyncio.to_thread(hold.reached.wait, 5)
        answers.append(shards[1].enqueue(send(b"another batch waits behind it")))
        answers.append(shards[2].enqueue(send(b"nothing waits behind it")))
        hold.release()
        await asyncio.wait_for(asyncio.gather(*answers), 5)
        for shard in shards:
            await shard.close()
        writers.shutdown()

    try:
        asyncio.run(scenario())
        assert [bodies_in(entry) for entry in first.committed_ahead()] == [[b"holds the thread"]]
        assert second.committed_ahead() == []  # the third shard's batch waited behind it
        assert [bodies_in(entry) for entry in third.committed_ahead()] == [[b"nothing waits behind it"]]
        assert stored_bodies(second) == [b"another batch waits behind it"]
    finally:
        for environment in (first, second, third):
            environment.close()


def test_on_the_writer_thread_a_batch_over_the_size_cap_commits_the_usual_way(
    environment: HeldCommitEnvironment,
) -> None:
    """Large batches come from load (clients fold their calls): written ahead, they would
    pay one more synchronous write; they are answered once LMDB committed them."""

    async def scenario() -> list[list[bytes]]:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)
        shard = committer(environment, writers)
        stored_when_answered: list[list[bytes]] = []
        for body in (b"L" * WRITE_AHEAD_MAX_BYTES, b"small"):
            answer = shard.enqueue(send(body))
            answer.add_done_callback(lambda _: stored_when_answered.append(stored_bodies(environment)))
            await asyncio.wait_for(answer, 5)
        await shard.close()
        writers.shutdown()
        return stored_when_answered

    stored_when_answered = asyncio.run(scenario())
    assert stored_when_answered[0] == [b"L" * WRITE_AHEAD_MAX_BYTES]
    assert [bodies_in(entry) for entry in environment.committed_ahead()] == [[b"small"]]


def test_a_read_waits_for_the_batches_answered_before_it_and_not_for_later_ones(
    environment: HeldCommitEnvironment,
) -> None:
    """until_committed (a queue's counts, a peek, an export wait on it) returns once LMDB
    holds what was answered before the call, and not later: under steady load there is
    always a batch answered and not yet committed, and a read waiting until none is
    would wait for good. (Here the read's wake-up after the first commit comes before
    the second batch is answered, so a read waiting until none is would return too: that
    interleaving is the loaded server's, where the event loop is slow to wake the read.)"""

    async def scenario() -> None:
        writers = WriterThreads(1, commit_on_loop_when_idle=False)
        shard = committer(environment, writers)
        first = environment.hold_next_commit()
        await asyncio.wait_for(shard.submit(send(b"first")), 5)
        assert await asyncio.to_thread(first.reached.wait, 5)
        read = asyncio.ensure_future(shard.until_committed())
        second = environment.hold_next_commit()
        answer = shard.enqueue(send(b"second"))  # answered after the read began
        await asyncio.sleep(0.2)
        assert not read.done()  # LMDB does not hold the first send yet
        first.release()
        assert [sent.seq for sent in await asyncio.wait_for(answer, 5)] == [2]
        assert await asyncio.to_thread(second.reached.wait, 5)
        await asyncio.wait_for(read, 5)  # while the second's commit is still held
        assert shard.answered_uncommitted
        assert stored_bodies(environment) == [b"first"]
        second.release()
        await asyncio.wait_for(shard.until_committed(), 5)
        assert stored_bodies(environment) == [b"first", b"second"]
        await shard.close()
        writers.shutdown()

    asyncio.run(scenario())
