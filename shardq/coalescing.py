"""Folding many concurrent small requests into few large ones.

Every call that arrives while earlier batches are in flight (or in the same
event-loop turn) joins the next batch, so throughput rises with concurrency
without adding a timer's worth of latency to a lone caller. A call made while
nothing is in flight or waiting goes out at once, from the caller's own task:
there is nothing to share a batch with, and waiting for the next loop turn and
a task of its own would only add latency. Used for single sends and batches onto
the producer stream, for acknowledgements on the consumer stream, and for unary
sends, deletes, visibility changes and short polls: the server's cost is per request
far more than per message.

A batch that is not full waits while another is in flight (as Nagle's algorithm
holds a small TCP segment), and the next batch forms at the end of the loop turn
in which the one in flight was answered, so the callers its answers woke join it.
Without this, a few callers each keeping one call in flight split into groups
that took turns: the first to call again went out alone, the rest in a second
batch right behind it, and on the server each group's commit (and fsync) waited
for the other's. Four callers sending single messages over one producer stream
waited 1.75 ms p50 per send where one caller waited 1.1; now 1.2 (bench/LATENCY.md).
Full batches still go out up to max_in_flight at once, so a bulk send
keeps its pipeline.

A server may refuse a whole request for what only some of its calls hold: one caller's
invalid message, or more messages than a queue has room for. Given `alone_on`, a batch
of several calls refused with such an error is sent again as one request per call, so
each caller gets its own answer and the others are stored: a refused request stored
nothing, so sending its parts again repeats nothing.

Callers woken together by one batch's answers often call again together, on another
batcher: four workers' shared receive answered, each deletes. Each batcher sends a call
alone when nothing of its own is out, so the first of them went out alone and the
rest together behind it. Batchers sharing a `WokenTogether` hold calls made while a
shared answer's callers are still running (to the end of that loop turn), so those
callers' next calls share one request. Workers that split into groups stay split (a
group answered alone wakes no one else), but into fewer: four workers draining a queue
made two receive and two delete requests a round instead of three of each.

Callers that take turns between batchers stay out of step once they fall out of it.
Workers that receive, then delete each message awaiting the answer, start one alone
and the rest together behind it (a lone call goes out at once), and that offset of one
call lasted for good: every round one receive went out alone and three together, and
one delete in ten did too. Batchers that are `Companions` (a queue's receives and
deletes) hold a lone call while another of them has a batch out or about to go, and
send it at the end of the loop turn in which one of them is answered: the callers that
answer wakes make their next calls then, and join it. The workers fall into step at
their first delete and stay there. A caller alone pays nothing: it has no batch out
on the other batcher when it calls.

A caller may give up (be cancelled) while its call is out, in a shared request, which goes
on for the others, or in one of its own. Given `unwanted`, what that caller's part of the
answer holds is handed to it: a receive's messages, claimed for nobody, go back to the
queue at once instead of at their visibility timeout. A lone call then goes out from a task
of its own, not its caller's: awaited in the caller's task, the caller's cancellation
cancelled the request under it, and an answer already on its way (a short poll cut off by
a 1 ms timeout had often been claimed and answered) was dropped with its messages claimed.
Without `unwanted` nothing needs catching, and a lone call still goes out from its caller's
task. A call given up before its batch went out is left out of it: nothing was sent for it,
so a send cancelled while it waited stores nothing, and a receive claims nothing for nobody.

Building a shared request may fail for what one caller passed (a `str` body, a `None`
receipt: protobuf raises TypeError or ValueError before anything is sent). Such a batch
is sent again call by call too, so the others' calls succeed and that caller alone gets
its error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def _failed_on_one_callers_input(error: Exception) -> bool:
    """Whether a batch failed while its request was built from some caller's input: protobuf
    and Python raise these for a value of the wrong type or out of range, before anything
    is sent, so sending the calls again one by one repeats nothing. The client turns every
    answer and transport failure into a ShardqError, none of which is one of these."""
    return isinstance(error, (TypeError, ValueError, AttributeError))


def _cancel_unanswered(batch: list[tuple[list[Item], asyncio.Future[list[Result]]]]) -> None:
    """The request of `batch` was cancelled itself (gRPC raises CancelledError from a call whose
    channel closed under it): its callers are cancelled too, where they waited for good."""
    for _, future in batch:
        if not future.done():
            future.cancel()


class WokenTogether:
    """Whether callers woken together by one batch's answers may still be making their
    next calls: from the answers until the end of that loop turn (event loop only)."""

    def __init__(self) -> None:
        self.active = False

    def mark(self) -> None:
        """Several callers were just answered: their tasks run next, then this clears."""
        if not self.active:
            self.active = True
            asyncio.get_running_loop().call_soon(self._clear)

    def _clear(self) -> None:
        self.active = False


class Companions:
    """Batchers whose calls the same callers make in turn (a queue's receives and deletes):
    a lone call on one waits while another has a batch out or about to go, and goes out
    at the end of the loop turn in which one of them is answered (event loop only)."""

    def __init__(self) -> None:
        self._members: list[Coalescer[Any, Any]] = []
        self._holding: list[Coalescer[Any, Any]] = []
        self._release_scheduled = False

    def join(self, member: Coalescer[Any, Any]) -> None:
        self._members.append(member)

    def others_busy(self, member: Coalescer[Any, Any]) -> bool:
        """Whether another member has a batch in flight or one due this loop turn: its
        callers, once answered, may call `member` next. Calls held here do not count, so
        two members never hold each other's."""
        return any(other is not member and other.sending for other in self._members)

    def hold(self, member: Coalescer[Any, Any]) -> None:
        if member not in self._holding:
            self._holding.append(member)

    def answered(self) -> None:
        """A member's batch was answered: release the held calls once the callers it
        woke have run (they were scheduled before this)."""
        if self._holding and not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._release)

    def _release(self) -> None:
        self._release_scheduled = False
        holding, self._holding = self._holding, []
        for member in holding:
            member.release()


class Coalescer(Generic[Item, Result]):
    def __init__(
        self,
        submit: Callable[[list[Item]], Awaitable[Sequence[Result]]],
        *,
        max_batch: int,
        max_in_flight: int,
        alone_on: Callable[[Exception], bool] | None = None,
        unwanted: Callable[[list[Result]], None] | None = None,
        woken: WokenTogether | None = None,
        companions: Companions | None = None,
    ) -> None:
        self._submit = submit
        self._woken = woken
        self._companions = companions
        if companions is not None:
            companions.join(self)
        self._alone_on = alone_on
        self._unwanted = unwanted
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        # One future per call's chunk, not per item: a future per item cost more
        # than the rest of a stream delete on the client.
        self._pending: list[tuple[list[Item], asyncio.Future[list[Result]]]] = []
        self._in_flight = 0
        self._flush_scheduled = False
        self._sending_alone: asyncio.Task[None] | None = None

    async def add(self, item: Item) -> Result:
        return (await self._run([item]))[0]

    async def add_many(self, items: Sequence[Item]) -> list[Result]:
        """The results of `items`, in order; a call over max_batch spans several batches."""
        if len(items) <= self._max_batch:
            return await self._run(list(items)) if items else []
        chunks = [list(items[start : start + self._max_batch]) for start in range(0, len(items), self._max_batch)]
        answers = [self._enqueue(chunk) for chunk in chunks]
        try:
            parts = await asyncio.gather(*answers)
        except asyncio.CancelledError:
            for answer in answers:
                self._hand_over_if_answered(answer)
            raise
        return [result for part in parts for result in part]

    @property
    def sending(self) -> bool:
        """A batch is in flight, or pending calls go out at the end of this loop turn."""
        return bool(self._in_flight or (self._pending and self._flush_scheduled))

    def release(self) -> None:
        """Send the calls held for a companion's answer (Companions)."""
        if self._pending and self._in_flight < self._max_in_flight:
            self._flush_soon()

    async def _run(self, chunk: list[Item]) -> list[Result]:
        if self._in_flight or self._pending or self._flush_scheduled or (self._woken and self._woken.active):
            answer = self._enqueue(chunk)
        elif self._companions is not None and self._companions.others_busy(self):
            # Held for the callers a companion's batch will wake: they call here next.
            self._companions.hold(self)
            answer = self._enqueue(chunk, flush=False)
        elif self._unwanted is None:
            # Alone: submitted now, in this task. Calls arriving meanwhile queue for the next batch.
            self._in_flight += 1
            try:
                return list(await self._submit(chunk))
            finally:
                self._answered_alone()
        else:
            # Alone, from a task of its own, so that the request outlives a caller who gives up
            # and its answer reaches `unwanted` (see the module docstring). It costs a task and a
            # future per lone call, and a loop turn each way, paid only where answers can be
            # unwanted (receives); awaiting the task itself would cancel it with the caller.
            self._in_flight += 1
            loop = asyncio.get_running_loop()
            answer = loop.create_future()
            # Held so that it is not collected while out: there is one at a time (in flight).
            self._sending_alone = loop.create_task(self._send_alone((chunk, answer)))
        try:
            return await answer
        except asyncio.CancelledError:
            self._hand_over_if_answered(answer)
            raise

    def _hand_over_if_answered(self, answer: asyncio.Future[list[Result]]) -> None:
        """Its caller was cancelled after `answer` was set, before it resumed to take it (the
        loop turn between them; a short poll cut off by a 1 ms timeout often was): what it
        holds goes to `unwanted`, as an answer arriving after the caller gave up does."""
        if self._unwanted is not None and answer.done() and not answer.cancelled() and answer.exception() is None:
            self._unwanted(answer.result())

    async def _send_alone(self, call: tuple[list[Item], asyncio.Future[list[Result]]]) -> None:
        try:
            await self._deliver([call])
        except BaseException:
            _cancel_unanswered([call])
            raise
        finally:
            # After the answer is set: its caller runs before the flush and the companions'
            # release this schedules, as it did when it sent the call from its own task.
            self._answered_alone()

    def _answered_alone(self) -> None:
        self._in_flight -= 1
        if self._pending:  # else this caller's next call may go out alone again, at once
            self._flush_soon()
        if self._companions is not None:
            self._companions.answered()

    def _enqueue(self, chunk: list[Item], *, flush: bool = True) -> asyncio.Future[list[Result]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Result]] = loop.create_future()
        self._pending.append((chunk, future))
        if flush and self._in_flight < self._max_in_flight:
            self._flush_soon()
        return future

    def _flush_soon(self) -> None:
        """Flush at the end of this loop turn: every call made in it joins the batch first,
        and so do the callers woken by the answer that just arrived."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if any(future.done() for _, future in self._pending):
            # Given up while waiting (a future is only ever done here by cancellation).
            self._pending = [call for call in self._pending if not call[1].done()]
        while self._pending and self._in_flight < self._max_in_flight:
            taken = 1
            size = len(self._pending[0][0])
            while taken < len(self._pending) and size + len(self._pending[taken][0]) <= self._max_batch:
                size += len(self._pending[taken][0])
                taken += 1
            if self._in_flight and size < self._max_batch:
                return  # not full: it waits for the batch in flight, and whoever that one's answers wake
            batch, self._pending = self._pending[:taken], self._pending[taken:]
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[list[Item], asyncio.Future[list[Result]]]]) -> None:
        try:
            await self._deliver(batch)
        except BaseException:
            _cancel_unanswered(batch)
            raise
        finally:
            self._in_flight -= 1
            # Even with nothing pending: the callers just answered call again from tasks that
            # run before the flush, and find it scheduled, so they share one batch.
            self._flush_soon()
            if self._companions is not None:
                self._companions.answered()

    async def _deliver(self, batch: list[tuple[list[Item], asyncio.Future[list[Result]]]]) -> None:
        try:
            results = await self._submit([item for chunk, _ in batch for item in chunk])
        except Exception as error:
            if len(batch) > 1 and (
                _failed_on_one_callers_input(error) or (self._alone_on is not None and self._alone_on(error))
            ):
                # Refused whole for what some calls hold: alone, each gets its own answer.
                await asyncio.gather(*(self._deliver([call]) for call in batch))
                return
            for _, future in batch:  # every caller of the batch gets the failure
                if not future.done():
                    future.set_exception(error)
        else:
            start = 0
            for chunk, future in batch:
                part = list(results[start : start + len(chunk)])
                if not future.done():
                    future.set_result(part)
                elif self._unwanted is not None:
                    self._unwanted(part)  # its caller gave up while the request was out
                start += len(chunk)
            if len(batch) > 1 and self._woken is not None:
                # After the answers: it clears once the tasks they woke have run.
                self._woken.mark()
