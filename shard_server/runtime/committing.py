"""Group commit: many requests, one write transaction, one fsync.

Requests for a shard queue up while the previous batch commits; the shard's
writer thread then runs every queued request in one transaction. Shards share
writer threads (WriterThreads): every thread running Python code competes for
the one GIL, and a thread per shard cost more in that contention than it ever
overlapped (see README, Performance). Answers go out after
the commit, except receives, which may answer as soon as their claims are
decided (DESIGN §5: a lost claim only means a redelivery, and the receipt of a
lost claim is rejected because the next claim carries a newer epoch or token).
A receive answers early only with messages whose sends are durable already
(committed, and replicated where the shard replicates): a claim on a message
sent in its own batch, or in one still replicating, answers with that batch,
since a SIGKILL before the commit would otherwise leave a consumer holding a
message the queue never stored, one that could not come back if left undeleted.

When nothing else waits for the shard's writer thread and the batch holds every
call the server is working on, the batch runs on the event loop itself instead,
at the end of the loop turn in which its first request arrived (so the requests
of that turn share it). A lone request then pays no thread hand-off either way:
handing work to the writer and its answer back cost two thread wake-ups, a GIL
hand-over and two event-loop turns, ~75 µs measured, a quarter of a quiet
commit's fsync (bench/LATENCY.md). Under load (requests that queued during a
commit, a batch starting sooner after one on the loop than that one took, other
calls in progress, several shards written in one turn) batches go to the writer,
so the event loop keeps serving while fsyncs run; batches that answer before
their commit (receives) always do. The commit, fsync included, is the same
transaction either way.

A standalone shard commits ahead (storage.commit_ahead): its batch's log entry is
made durable in one write before LMDB commits, and the batch is answered then. On the
writer thread the answers are handed to the event loop and the thread commits; on the
event loop the answers go out first and the commit runs a few loop turns later, once
their responses are with gRPC. Either way LMDB's commit no longer delays the answers,
only the shard's next batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from shard_server.domain.context import ShardContext
from shard_server.storage.lmdb_store import (
    LmdbShardTransaction,
    OpenBatch,
    ShardEnvironment,
    let_lmdb_calls_release_the_gil,
)
from shardq.errors import Reason, ShardqError

T = TypeVar("T")
Work = Callable[[LmdbShardTransaction, ShardContext, int], T]
# For work that may answer before its commit: the newest message seq its outcome
# hands out (0 for none), so the answer waits when that message is not durable yet.
NewestSeq = Callable[[T], int]

log = logging.getLogger(__name__)

# Loop turns between answering a batch committed ahead on the event loop and its LMDB
# commit there (see GroupCommitter._run_batch_on_loop).
LOOP_TURNS_BEFORE_COMMIT = 4
# Batches on the writer thread with a larger log entry commit the usual way (see
# GroupCommitter._nothing_waits): about 45 sends of one 256-byte message, more than
# four callers' ten-message sends.
WRITE_AHEAD_MAX_BYTES = 16 << 10


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclasses.dataclass(slots=True)
class _Request(Generic[T]):
    work: Work[T]
    future: asyncio.Future[T]
    # Set for work that may answer before its commit (see NewestSeq).
    answer_before_commit: NewestSeq[T] | None


@dataclasses.dataclass(slots=True)
class _Batch:
    """What the writer thread did with one batch: outcomes and report, or the error."""

    requests: list[_Request[Any]]
    outcomes: list[tuple[bool, Any]]
    report: CommitReport | None
    error: Exception | None = None


@dataclasses.dataclass(slots=True)
class _Begun:
    """A batch whose work ran in a write transaction not yet committed (GroupCommitter._begin)."""

    requests: list[_Request[Any]]
    outcomes: list[tuple[bool, Any]]
    opened: OpenBatch[None]
    at_ms: int
    epoch: int
    last_seq: int
    # When the transaction began (perf_counter): CommitReport.seconds runs from here.
    started: float

    def answers(self) -> list[tuple[asyncio.Future[Any], bool, Any]]:
        return [(request.future, *outcome) for request, outcome in zip(self.requests, self.outcomes, strict=True)]


@dataclasses.dataclass(frozen=True, slots=True)
class CommitReport:
    """What one committed batch did: for metrics and for waking receivers."""

    requests: int
    log_index: int
    at_ms: int
    epoch: int
    # Replicated shards: the newest message seq once the batch committed (durable when
    # the batch has replicated); 0 otherwise.
    last_seq: int = 0
    # From the write transaction's start until the batch was durable: its LMDB work and
    # the synchronous writes that made it so (the commit-ahead write, when there was one,
    # else LMDB's commit): what the disk costs every answer that waits.
    seconds: float = 0.0
    # Answered once its entry was written ahead, before LMDB's commit (commit ahead).
    written_ahead: bool = False


class CallsInProgress:
    """How many data-plane calls the server is working on (event loop only); a call
    waiting in a long poll is not working. `with calls:` counts one for the block."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        self.count -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not counted for the block (a long poll waiting for messages)."""
        self.count -= 1
        try:
            yield
        finally:
            self.count += 1


class WriterThread:
    """One thread running write transactions, and how much work it has (event loop only)."""

    def __init__(self, name: str, *, commit_on_loop_when_idle: bool, calls: CallsInProgress) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Whether a batch may run on the event loop while this thread is idle (see the module docstring).
        self.commit_on_loop_when_idle = commit_on_loop_when_idle
        # The server's calls in progress: a batch holding fewer requests than there are
        # calls leaves the event loop other work to do while its fsync runs.
        self.calls = calls
        # When the last batch run on the event loop answered, and how long it blocked the loop
        # until then: calls that gRPC received meanwhile are not counted anywhere yet.
        self.loop_commit_ended_at = 0.0
        self.loop_commit_took = 0.0
        # Batches and exclusive work handed to the thread and not yet finished, and
        # batches about to run on the event loop: the thread counts as busy while
        # either may be running, so two shards never commit on the loop in a row
        # while the thread stands idle.
        self.outstanding = 0
        # Batches handed to the thread, counted on the event loop, and batches it has
        # started, counted on the thread (each written by one thread only): the
        # difference is how many wait behind the one running.
        self.batches_submitted = 0
        self.batches_started = 0

    @property
    def idle(self) -> bool:
        return self.outstanding == 0

    @property
    def batches_waiting(self) -> int:
        """Batches handed to the thread that it has not started (any thread may ask)."""
        return self.batches_submitted - self.batches_started


class WriterThreads:
    """The threads that run write transactions, shared by every shard of a server.

    A shard stays on one thread for its whole life: LMDB write transactions
    belong to the thread that began them, and a shard's batches and exclusive
    work (follower appends, snapshots) must run in order. Several threads only
    pay off when fsync is slow enough (network disks) to overlap usefully, and
    only with LMDB calls releasing the GIL, which they are then made to do.
    """

    def __init__(self, count: int = 1, *, commit_on_loop_when_idle: bool = True, commit_ahead: bool = True) -> None:
        if count < 1:
            raise ValueError(f"writer threads must be at least 1, got {count}")
        if count > 1:
            let_lmdb_calls_release_the_gil()
        self.calls = CallsInProgress()
        # Whether standalone shards' environments commit ahead (storage.commit_ahead).
        self.commit_ahead = commit_ahead
        self._threads = [
            WriterThread(f"writer-{i}", commit_on_loop_when_idle=commit_on_loop_when_idle, calls=self.calls)
            for i in range(count)
        ]
        self._next = itertools.count()

    def assign(self) -> WriterThread:
        """The thread for a new shard (round robin)."""
        return self._threads[next(self._next) % len(self._threads)]

    def shutdown(self) -> None:
        for thread in self._threads:
            thread.executor.shutdown(wait=True)


class GroupCommitter:
    def __init__(
        self,
        environment: ShardEnvironment,
        context: Callable[[], ShardContext],
        *,
        thread: WriterThread,
        on_commit: Callable[[CommitReport], None],
        replicated: Callable[[int, int], Awaitable[None]] | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.environment = environment
        # Resolves once a log index is held by every in-sync replica (cluster
        # mode); answers to writes wait for it, receives do not.
        self._replicated = replicated
        self._context = context
        self._on_commit = on_commit
        self._clock_ms = clock_ms
        # This shard's writer thread (shared with other shards, see WriterThreads).
        self._thread = thread
        # Set when LMDB failed to commit a batch already answered from the commit-ahead file:
        # nothing more may be written over the missing batch until reopening recovers it.
        self._stopped_by: Exception | None = None
        # Batches answered before their LMDB commit, and how many of them LMDB has
        # committed (batches of a shard run one at a time, so a finished batch settles all
        # answered so far); `_committed` is set each time a batch finishes.
        self._answered_ahead = 0
        self._settled_ahead = 0
        self._committed = asyncio.Event()
        # Set while a batch is due on the event loop: exclusive work waits for it.
        self._loop_batch: asyncio.Future[None] | None = None
        # Appended on the event loop, taken whole by the writer thread.
        self._pending: list[_Request[Any]] = []
        self._pending_lock = threading.Lock()
        # A batch is queued or running, on the writer thread or the event loop (event loop only).
        self._busy = False
        # The busy batch has not taken its requests yet: a request queued now joins it.
        self._collecting = False
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_now_ms = 0
        # Replicated shards: every message up to this seq is held by every in-sync replica
        # (0 until this copy's first batch as leader replicates: what it holds from before
        # may not be). Written on the event loop, read by the batch on the writer thread.
        self._replicated_seq = 0
        # Exclusive work still on the writer thread: close() waits for it, since
        # the thread outlives this shard's environment.
        self._exclusive: set[asyncio.Future[Any]] = set()

    async def submit(self, work: Work[T], *, answer_before_commit: NewestSeq[T] | None = None) -> T:
        return await self.enqueue(work, answer_before_commit=answer_before_commit)

    def enqueue(self, work: Work[T], *, answer_before_commit: NewestSeq[T] | None = None) -> asyncio.Future[T]:
        """Queue `work` for the next batch; the future holds its outcome.

        For callers feeding several shards at once: awaiting futures together
        costs no task per shard, as awaiting several submit() calls would.
        """
        if self._closed:
            raise ShardqError(Reason.SHUTTING_DOWN, "the server is shutting down")
        if self._stopped_by is not None:
            raise self._stopped_refusal()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._pending_lock:
            self._pending.append(_Request(work, future, answer_before_commit))
        if not self._busy:
            self._start_batch(loop)
        return future

    def _stopped_refusal(self) -> ShardqError:
        return ShardqError(
            Reason.UNAVAILABLE,
            f"this shard stopped writing when a commit failed ({self._stopped_by}); "
            "restarting the server recovers its last batch from the commit-ahead file",
        )

    @property
    def answered_uncommitted(self) -> bool:
        """A batch was answered before its LMDB commit and that commit has not finished:
        what it wrote is not in read transactions yet, only in requests queued here."""
        return self._settled_ahead < self._answered_ahead

    async def until_committed(self) -> None:
        """Return once LMDB holds every batch answered before this call: a read made after
        it sees every write its caller was answered for (read-your-writes for counts and
        peeks). Batches answered later are not waited for, so steady load cannot starve it."""
        target = self._answered_ahead
        while self._settled_ahead < target:
            self._committed.clear()
            await self._committed.wait()

    @property
    def collecting(self) -> bool:
        """A batch is due to start and has not taken its requests yet: a request queued
        now shares its transaction and fsync instead of paying for another."""
        return self._collecting

    def _start_batch(self, loop: asyncio.AbstractEventLoop, *, after_a_batch: bool = False) -> None:
        self._busy = True
        self._collecting = True
        self._idle.clear()
        thread = self._thread
        # Requests that queued while a batch committed mean load: on the event loop their
        # batch's fsync would hold up the calls arriving meanwhile, which gRPC has received
        # but this server has not seen (so they are not counted in progress either).
        on_loop = not after_a_batch and thread.commit_on_loop_when_idle and thread.idle
        thread.outstanding += 1
        if on_loop:
            # At the end of this loop turn: requests arriving in the same turn join.
            self._loop_batch = loop.create_future()
            loop.call_soon(self._run_batch_on_loop, loop)
            return
        self._submit_batch(loop)

    def _submit_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread.batches_submitted += 1
        done = self._thread.executor.submit(self._run_batch, loop)
        done.add_done_callback(lambda finished: loop.call_soon_threadsafe(self._finish_batch, loop, finished))

    def _run_batch_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._pending_lock:
            requests = len(self._pending)
            answers_early = any(request.answer_before_commit is not None for request in self._pending)
        due, self._loop_batch = self._loop_batch, None
        thread = self._thread
        started = time.monotonic()
        # A batch starting sooner after the last one on the loop answered than that one
        # took to answer means calls kept arriving while the loop was blocked: that is load.
        soon_after = started - thread.loop_commit_ended_at < thread.loop_commit_took
        if answers_early or soon_after or thread.outstanding > 1 or thread.calls.count > requests:
            # A receive answers as soon as its claims are decided, while the commit runs:
            # on the event loop its answer could only go out after the fsync. And when
            # other calls are in progress (other shards' batches went to the writer, or
            # calls are being received or answered), the loop has their work to do while
            # this batch's fsync runs on the writer.
            try:
                self._submit_batch(loop)
            finally:
                if due is not None:
                    due.set_result(None)  # exclusive work may be queued now: it runs after this batch
            return
        with self._pending_lock:
            batch, self._pending = self._pending, []
            self._collecting = False
        try:
            begun = self._begin(loop, batch)
        except Exception as error:
            self._note_loop_blocked(started)
            self._finish_on_loop(loop, _Batch(batch, [], None, error), due)
            return
        if not begun.opened.written_ahead:
            completed = self._completed(begun)
            self._note_loop_blocked(started)
            self._finish_on_loop(loop, completed, due)
            return
        # Durable already: answered now, and committed to LMDB a few loop turns later, once
        # the answers' handlers have handed their responses to gRPC, whose own thread sends
        # them while this thread commits. A unary send's handler does in one turn; a stream's
        # answer goes through a task, a queue and the response generator, and an
        # acknowledgement on a consume stream through a gather besides: four turns let
        # them all out first (two left stream deletes waiting for the commit: README,
        # Latency). What the answers waited for is what tells load apart (soon_after).
        self._answered_ahead += 1
        _resolve_all(begun.answers())
        self._note_loop_blocked(started)
        _after_loop_turns(
            loop, LOOP_TURNS_BEFORE_COMMIT, lambda: self._finish_on_loop(loop, self._completed(begun), due)
        )

    def _note_loop_blocked(self, started: float) -> None:
        """The batch on the event loop has answered; it blocked the loop since `started`."""
        thread = self._thread
        thread.loop_commit_ended_at = time.monotonic()
        thread.loop_commit_took = thread.loop_commit_ended_at - started

    def _completed(self, begun: _Begun) -> _Batch:
        try:
            return _Batch(begun.requests, begun.outcomes, self._complete(begun))
        except Exception as error:
            return _Batch(begun.requests, [], None, error)

    def _finish_on_loop(self, loop: asyncio.AbstractEventLoop, batch: _Batch, due: asyncio.Future[None] | None) -> None:
        try:
            finished: concurrent.futures.Future[_Batch] = concurrent.futures.Future()
            finished.set_result(batch)
            self._finish_batch(loop, finished)
        finally:
            if due is not None:
                due.set_result(None)  # exclusive work may be queued now: it runs after this batch

    def _run_batch(self, loop: asyncio.AbstractEventLoop) -> _Batch:
        """A batch on the writer thread: begun, answered if written ahead, committed."""
        self._thread.batches_started += 1
        # The batch is formed when the writer thread gets to it, not when it was
        # queued: the thread is shared, and everything that arrived while other
        # shards were committing joins this one transaction and fsync.
        with self._pending_lock:
            batch, self._pending = self._pending, []
            self._collecting = False
        try:
            # A batch whose every request answers before the commit (receives: their claims
            # are answered once decided) has no answer for the write ahead to hasten, while
            # the requests queued behind it (a worker's first delete after its receive) wait
            # for the writer: a 40-message claim batch held it 1.43 ms not written ahead
            # against 1.77 ms written ahead (bench/LATENCY.md). Not written ahead, LMDB's
            # commit syncs its meta page itself (ShardEnvironment.sync_if_committed), so the
            # batch is as durable when the commit returns, and the records of the batches
            # after it still chain on recovery.
            answered_early = all(request.answer_before_commit is not None for request in batch)
            write_ahead_if = _never if answered_early else self._nothing_waits
            begun = self._begin(loop, batch, write_ahead_if=write_ahead_if)
            try:
                if begun.opened.written_ahead:
                    self._answered_ahead += 1  # before any caller can learn of the answers
                    loop.call_soon_threadsafe(_resolve_all, begun.answers())
            finally:
                report = self._complete(begun)
            return _Batch(batch, begun.outcomes, report)
        except Exception as error:  # answered on the event loop, request by request
            return _Batch(batch, [], None, error)

    def _nothing_waits(self, entry_bytes: int) -> bool:
        """Whether a batch on the writer thread is written ahead: while nothing waits for
        the thread and the batch is small. Writing ahead takes LMDB's commit out of the
        batch's answers, but under load it is one more synchronous write before the
        requests that queued meanwhile (for this shard, or other shards' batches sharing
        the thread) get their turn, and the wake-up that hands the answers over early is
        CPU a saturated server lacks: saturation fell 5-13% with every batch written
        ahead (bench/LATENCY.md). Large batches come from load, when clients fold their
        calls: answered sooner, they fold less, and pay more CPU per message."""
        if entry_bytes > WRITE_AHEAD_MAX_BYTES:
            return False
        with self._pending_lock:
            requests_waiting = bool(self._pending)
        return not requests_waiting and self._thread.batches_waiting == 0

    def _begin(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Request[Any]],
        *,
        write_ahead_if: Callable[[int], bool] | None = None,
    ) -> _Begun:
        """Run the batch's work in a write transaction and add its log entry (written ahead
        when the environment commits ahead); committed by _complete, on the same thread."""
        if self._stopped_by is not None:
            # Queued while the failed batch ran: written now, it would build on state that
            # lacks that batch, and the commit-ahead file would lose it.
            raise self._stopped_refusal()
        # Non-decreasing per shard, so seq order is send-time order (retention relies on it).
        now_ms = max(self._clock_ms(), self._last_now_ms)
        self._last_now_ms = now_ms
        context = self._context()
        outcomes: list[tuple[bool, Any]] = []

        last_seq = 0
        may_answer_early = any(request.answer_before_commit is not None for request in batch)

        def run_all(tx: LmdbShardTransaction) -> None:
            nonlocal last_seq
            durable_seq = 0
            if may_answer_early:
                # Sends committed before this batch are durable, unless they still replicate.
                durable_seq = tx.last_seq() if self._replicated is None else self._replicated_seq
            early: list[tuple[asyncio.Future[Any], bool, Any]] = []
            for request in batch:
                try:
                    outcome: tuple[bool, Any] = (True, request.work(tx, context, now_ms))
                except ShardqError as error:
                    outcome = (False, error)
                outcomes.append(outcome)
                newest_seq = request.answer_before_commit
                if newest_seq is not None and (not outcome[0] or newest_seq(outcome[1]) <= durable_seq):
                    early.append((request.future, *outcome))
            if early:
                # Answered before the commit: reads wait for it (until_committed), as they
                # do for a batch answered from the commit-ahead file, so that a count made
                # once a receive is answered sees its claims.
                self._answered_ahead += 1
                loop.call_soon_threadsafe(_resolve_all, early)
            if self._replicated is not None:  # what _replicated_seq advances to once replicated
                last_seq = tx.last_seq()

        started = time.perf_counter()
        opened = self.environment.begin_batch(run_all, epoch=context.epoch, at_ms=now_ms, write_ahead_if=write_ahead_if)
        return _Begun(batch, outcomes, opened, now_ms, context.epoch, last_seq, started)

    def _complete(self, begun: _Begun) -> CommitReport:
        try:
            begun.opened.commit()
        except Exception as error:
            if begun.opened.written_ahead:
                log.critical("a commit failed after its batch was answered; this shard stops writing", exc_info=True)
                self._stopped_by = error
            raise
        # Until durable: what the batch's answers waited for (the write ahead, when there was one).
        durable_at = begun.opened.written_ahead_at or time.perf_counter()
        took = durable_at - begun.started
        return CommitReport(
            len(begun.requests),
            begun.opened.index,
            begun.at_ms,
            begun.epoch,
            begun.last_seq,
            seconds=took,
            written_ahead=begun.opened.written_ahead,
        )

    def _finish_batch(self, loop: asyncio.AbstractEventLoop, finished: concurrent.futures.Future[_Batch]) -> None:
        self._thread.outstanding -= 1
        self._busy = False
        self._settled_ahead = self._answered_ahead
        self._committed.set()
        result = finished.result()  # _run_batch catches what the work raised
        batch = result.requests
        if result.error is not None or result.report is None:
            log.error("shard commit failed; %d requests get an error", len(batch), exc_info=result.error)
            error = result.error
            if not isinstance(error, ShardqError):
                error = ShardqError(Reason.UNAVAILABLE, f"commit failed: {error}")
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(error)
        else:
            report = result.report
            answers = [(request.future, ok, value) for request, (ok, value) in zip(batch, result.outcomes, strict=True)]
            self._on_commit(report)
            if self._replicated is not None and report.log_index:
                # The next batch may commit locally meanwhile: replication is pipelined.
                loop.create_task(self._answer_when_replicated(report, answers))
            else:
                _resolve_all(answers)
        with self._pending_lock:
            more = bool(self._pending)
        if more:
            self._start_batch(loop, after_a_batch=True)
        else:
            self._idle.set()

    async def _answer_when_replicated(
        self, report: CommitReport, answers: list[tuple[asyncio.Future[Any], bool, Any]]
    ) -> None:
        assert self._replicated is not None
        try:
            await self._replicated(report.log_index, report.epoch)
        except ShardqError as error:
            # Written here but not known to be replicated: the client must treat
            # the outcome as unknown, exactly as after a lost connection.
            _resolve_all([(future, False, error) for future, _, _ in answers])
        else:
            # Replicated through this batch means through every batch before it too.
            self._replicated_seq = max(self._replicated_seq, report.last_seq)
            _resolve_all(answers)

    async def run_exclusive(self, work: Callable[[], T]) -> T:
        """Run `work` on the writer thread, between batches (follower appends, snapshots).

        A batch already queued runs first, with whatever requests are pending
        when it starts.
        """
        loop = asyncio.get_running_loop()
        thread = self._thread
        # What a follower appends or truncates was replicated by another leader, or not:
        # early receives wait again until this copy's own batch has replicated.
        self._replicated_seq = 0
        # Counted from now, so this shard's next batches go to the thread, in order with `work`.
        thread.outstanding += 1
        try:
            if self._loop_batch is not None:
                await asyncio.shield(self._loop_batch)  # due on the event loop: it runs first
        except BaseException:
            thread.outstanding -= 1
            raise
        running = asyncio.wrap_future(thread.executor.submit(work), loop=loop)
        self._exclusive.add(running)

        def finished(done: asyncio.Future[T]) -> None:
            thread.outstanding -= 1
            self._exclusive.discard(done)

        running.add_done_callback(finished)
        return await running

    async def until_idle(self) -> None:
        """Return once no batch is queued or running (the answers to a replicated shard's
        writes may still wait for their replication)."""
        while self._busy or self._pending:
            await self._idle.wait()

    async def close(self) -> None:
        """Stop taking requests and finish every commit already queued."""
        self._closed = True
        await self.until_idle()
        if self._exclusive:
            await asyncio.wait(set(self._exclusive))


def _after_loop_turns(loop: asyncio.AbstractEventLoop, turns: int, callback: Callable[[], None]) -> None:
    """Run `callback` on the event loop `turns` turns from now (what those turns schedule first runs first)."""
    if turns <= 0:
        callback()
    else:
        loop.call_soon(_after_loop_turns, loop, turns - 1, callback)


def _never(_entry_bytes: int) -> bool:
    return False


def _resolve_all(outcomes: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in outcomes:
        if future.done():
            continue  # answered before commit, or the caller went away
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
