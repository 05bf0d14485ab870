"""The coalescer folds concurrent calls into batches no larger than max_batch,
hands every caller exactly its own results in order, and fails a batch's callers together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from shardq.coalescing import Coalescer, Companions, WokenTogether


class Recorder:
    """A submit function that records each batch and answers item * 10."""

    def __init__(self, *, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(items)
        await asyncio.sleep(0)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"batch with {self.fail_on} failed")
        return [item * 10 for item in items]


def test_concurrent_calls_share_batches_and_get_their_own_results() -> None:
    async def scenario() -> None:
        submit = Recorder()
        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=5, max_in_flight=1)
        calls = [[1, 2], [3], [4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
        results = await asyncio.gather(*(coalescer.add_many(call) for call in calls), coalescer.add(99))
        assert results == [[i * 10 for i in call] for call in calls] + [990]
        assert all(len(batch) <= 5 for batch in submit.batches)
        # The first call found nothing in flight and went out alone, at once; the five
        # chunks after it (the 7-item call is two) shared three batches.
        assert submit.batches == [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 99]]

    asyncio.run(scenario())


def test_a_lone_call_is_submitted_from_the_callers_own_task() -> None:
    """Nothing in flight, nothing waiting: no loop turn and no task of its own in between."""

    async def scenario() -> None:
        submitted_from: list[asyncio.Task[object] | None] = []

        async def submit(items: list[int]) -> list[int]:
            submitted_from.append(asyncio.current_task())
            return [item * 10 for item in items]

        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=5, max_in_flight=2)
        caller = asyncio.current_task()
        assert await coalescer.add(1) == 10
        assert await coalescer.add_many([2, 3]) == [20, 30]
        assert submitted_from == [caller, caller]

    asyncio.run(scenario())


def test_a_failed_batch_fails_its_callers_only() -> None:
    async def scenario() -> None:
        submit = Recorder(fail_on=3)
        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=2, max_in_flight=1)
        outcomes = await asyncio.gather(
            coalescer.add_many([1, 2]), coalescer.add_many([3]), coalescer.add_many([4]), return_exceptions=True
        )
        assert outcomes[0] == [10, 20]
        assert isinstance(outcomes[1], RuntimeError)
        # [4] shared the failed batch with [3] (max_batch 2), so it failed too; nothing else did.
        assert submit.batches == [[1, 2], [3, 4]]
        assert isinstance(outcomes[2], RuntimeError)
        assert await coalescer.add(5) == 50

    asyncio.run(scenario())


def test_a_batch_refused_for_one_callers_input_is_sent_again_call_by_call() -> None:
    """A server refuses a whole request for one invalid part; the others' calls must not
    fail with it, and the refusal must reach the caller whose input it was."""

    async def scenario() -> None:
        submit = Recorder(fail_on=3)
        coalescer: Coalescer[int, int] = Coalescer(
            submit, max_batch=10, max_in_flight=1, alone_on=lambda error: isinstance(error, RuntimeError)
        )
        outcomes = await asyncio.gather(
            coalescer.add_many([1]),
            coalescer.add_many([2]),
            coalescer.add_many([3]),
            coalescer.add_many([4, 5]),
            return_exceptions=True,
        )
        assert outcomes[0] == [10]
        assert outcomes[1] == [20]
        assert isinstance(outcomes[2], RuntimeError)
        assert outcomes[3] == [40, 50]
        # [1] alone at once; [2] [3] [4, 5] shared a batch, refused, then went one by one.
        assert submit.batches[:2] == [[1], [2, 3, 4, 5]]
        assert sorted(submit.batches[2:]) == [[2], [3], [4, 5]]

    asyncio.run(scenario())


def test_other_failures_still_fail_the_whole_batch() -> None:
    async def scenario() -> None:
        submit = Recorder(fail_on=3)
        coalescer: Coalescer[int, int] = Coalescer(
            submit, max_batch=10, max_in_flight=1, alone_on=lambda error: isinstance(error, KeyError)
        )
        outcomes = await asyncio.gather(coalescer.add(1), coalescer.add(2), coalescer.add(3), return_exceptions=True)
        assert outcomes[0] == 10
        assert isinstance(outcomes[1], RuntimeError)
        assert isinstance(outcomes[2], RuntimeError)
        assert submit.batches == [[1], [2, 3]]

    asyncio.run(scenario())


def test_an_empty_call_sends_nothing() -> None:
    async def scenario() -> None:
        submit = Recorder()
        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=3, max_in_flight=2)
        assert await coalescer.add_many([]) == []
        assert submit.batches == []

    asyncio.run(scenario())


@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_a_call_larger_than_max_batch_spans_batches_in_order(size: int) -> None:
    async def scenario() -> None:
        submit = Recorder()
        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=3, max_in_flight=4)
        items = list(range(size))
        assert await coalescer.add_many(items) == [i * 10 for i in items]
        assert all(len(batch) <= 3 for batch in submit.batches)

    asyncio.run(scenario())


def test_callers_each_keeping_one_call_in_flight_share_one_batch() -> None:
    """Four callers, each calling again as soon as answered: they settle into one batch
    per round, not a lone call and the other three right behind it taking turns (each
    group then waited for the other's commit on the server)."""

    async def scenario() -> None:
        batches: list[list[tuple[int, int]]] = []
        in_flight: list[int] = []
        busy = 0

        async def submit(items: list[tuple[int, int]]) -> list[int]:
            nonlocal busy
            batches.append(items)
            busy += 1
            in_flight.append(busy)
            await asyncio.sleep(0.002)
            busy -= 1
            return [caller for caller, _ in items]

        coalescer: Coalescer[tuple[int, int], int] = Coalescer(submit, max_batch=100, max_in_flight=8)

        async def caller(number: int) -> None:
            for round_ in range(6):
                assert await coalescer.add((number, round_)) == number

        await asyncio.gather(*(caller(number) for number in range(4)))
        # The first caller went out alone; the other three waited for it (a partial
        # batch never goes while one is in flight) and took the first one's next call along.
        assert [len(batch) for batch in batches[:2]] == [1, 4]
        assert all(len(batch) == 4 for batch in batches[1:-1]), batches
        assert max(in_flight) == 1

    asyncio.run(scenario())


def test_full_batches_go_out_while_others_are_in_flight() -> None:
    """A bulk call keeps its pipeline: full batches go out up to max_in_flight at once,
    and only the partial tail waits for them."""

    async def scenario() -> None:
        busy = 0
        most = 0
        sizes: list[tuple[int, int]] = []

        async def submit(items: list[int]) -> list[int]:
            nonlocal busy, most
            busy += 1
            most = max(most, busy)
            sizes.append((len(items), busy))
            await asyncio.sleep(0.002)
            busy -= 1
            return [item * 10 for item in items]

        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=10, max_in_flight=3)
        items = list(range(45))
        assert await coalescer.add_many(items) == [i * 10 for i in items]
        assert most == 3
        # The four full batches went out three at once; the tail of 5 went out alone.
        assert sorted(size for size, _ in sizes) == [5, 10, 10, 10, 10]
        assert sizes[-1] == (5, 1)

    asyncio.run(scenario())


def test_the_answer_of_a_caller_that_gave_up_goes_to_unwanted() -> None:
    """A caller cancelled while its call is out in a shared batch: the batch goes on for the
    others, and that caller's part of the answer is handed to `unwanted` (for receives:
    messages claimed for nobody), not dropped."""

    async def scenario() -> None:
        unwanted: list[list[str]] = []
        out = asyncio.Event()

        async def submit(items: list[int]) -> list[str]:
            out.set()
            await asyncio.sleep(0.002)
            return [f"answer {item}" for item in items]

        coalescer: Coalescer[int, str] = Coalescer(submit, max_batch=10, max_in_flight=1, unwanted=unwanted.append)
        blocker = asyncio.create_task(coalescer.add(0))
        await out.wait()  # out alone; the next three wait and go out together after it
        out.clear()
        calls = [asyncio.create_task(coalescer.add(number)) for number in range(1, 4)]
        assert await blocker == "answer 0"
        await out.wait()  # the three are out now
        calls[1].cancel()
        answers = [await call for position, call in enumerate(calls) if position != 1]
        assert answers == ["answer 1", "answer 3"]
        assert unwanted == [["answer 2"]]

    asyncio.run(scenario())


def test_a_call_given_up_before_its_batch_went_out_is_left_out_of_it() -> None:
    """Nothing was sent for a call cancelled while it waited for the batch in flight: the
    next batch goes without it (a send so cancelled stores nothing, a receive claims
    nothing for nobody), and a batch of only such calls is never sent."""

    async def scenario() -> None:
        batches: list[list[int]] = []
        answer = asyncio.Event()

        async def submit(items: list[int]) -> list[int]:
            batches.append(items)
            await answer.wait()
            answer.clear()
            return [item * 10 for item in items]

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        coalescer: Coalescer[int, int] = Coalescer(submit, max_batch=10, max_in_flight=1)
        first = asyncio.create_task(coalescer.add(0))
        await settle()  # out alone, held open until answered
        waiting = [asyncio.create_task(coalescer.add(number)) for number in (1, 2, 3)]
        await settle()
        waiting[1].cancel()
        answer.set()
        assert await first == 0
        await settle()  # the waiting calls' batch is out
        answer.set()
        assert [await waiting[0], await waiting[2]] == [10, 30]
        alone = asyncio.create_task(coalescer.add(4))
        await settle()
        gone = asyncio.create_task(coalescer.add(5))
        await settle()
        gone.cancel()
        answer.set()
        assert await alone == 40
        await settle()
        assert batches == [[0], [1, 3], [4]]

    asyncio.run(scenario())


def test_callers_woken_together_make_their_next_calls_together_on_another_batcher() -> None:
    """Four workers, each receiving then deleting, on two batchers sharing a WokenTogether:
    the callers one shared answer woke make their next call, on the other batcher, in one
    batch. The first worker, answered alone, stays a group of its own: two batches a round
    on each batcher. Without it the first of the woken callers went out alone every time,
    and the workers fell into three groups."""

    async def scenario(woken: WokenTogether | None) -> tuple[list[int], list[int]]:
        receives: list[int] = []
        deletes: list[int] = []

        def recording(sizes: list[int]) -> Callable[[list[int]], Awaitable[list[int]]]:
            async def submit(items: list[int]) -> list[int]:
                sizes.append(len(items))
                for _ in range(3):  # a round trip of a few loop turns: no timers, so no ties
                    await asyncio.sleep(0)
                return items

            return submit

        receiver: Coalescer[int, int] = Coalescer(recording(receives), max_batch=16, max_in_flight=4, woken=woken)
        deleter: Coalescer[int, int] = Coalescer(recording(deletes), max_batch=16, max_in_flight=4, woken=woken)

        async def worker(number: int) -> None:
            for _ in range(6):
                await receiver.add(number)
                await deleter.add(number)

        await asyncio.gather(*(worker(number) for number in range(4)))
        return receives, deletes

    assert asyncio.run(scenario(WokenTogether())) == ([1, 3] * 6, [1, 3] * 6)
    assert asyncio.run(scenario(None)) == ([1, 3] + [1, 1, 2] * 5, [1, 1, 2] * 6)


def test_workers_taking_turns_between_companion_batchers_fall_into_step() -> None:
    """The same four workers on batchers that are Companions: the first worker's delete,
    made while the other three's receive is due, waits for that receive's answer and goes
    out with their deletes. From then on one batch a round on each batcher, where the
    WokenTogether alone left the first worker a call ahead for good ([1, 3] every round)."""

    async def scenario() -> tuple[list[int], list[int]]:
        receives: list[int] = []
        deletes: list[int] = []

        def recording(sizes: list[int]) -> Callable[[list[int]], Awaitable[list[int]]]:
            async def submit(items: list[int]) -> list[int]:
                sizes.append(len(items))
                for _ in range(3):
                    await asyncio.sleep(0)
                return items

            return submit

        woken, companions = WokenTogether(), Companions()
        receiver: Coalescer[int, int] = Coalescer(
            recording(receives), max_batch=16, max_in_flight=4, woken=woken, companions=companions
        )
        deleter: Coalescer[int, int] = Coalescer(
            recording(deletes), max_batch=16, max_in_flight=4, woken=woken, companions=companions
        )

        async def worker(number: int) -> None:
            for _ in range(6):
                assert await receiver.add(number) == number
                assert await deleter.add(number) == number

        await asyncio.gather(*(worker(number) for number in range(4)))
        return receives, deletes

    assert asyncio.run(scenario()) == ([1, 3] + [4] * 5, [4] * 6)


def test_a_call_held_for_a_companion_goes_out_when_that_batch_is_answered_even_alone() -> None:
    """A held call never waits for company that does not come: once the companion's batch
    is answered it goes out, whether or not that answer's callers call again. And a lone
    call whose companions have nothing out goes at once, from its caller's own task."""

    async def scenario() -> None:
        order: list[str] = []
        answer_slow = asyncio.Event()

        async def slow(items: list[int]) -> list[int]:
            order.append(f"slow {items}")
            await answer_slow.wait()
            return items

        async def fast(items: list[int]) -> list[int]:
            order.append(f"fast {items}")
            return items

        companions = Companions()
        first: Coalescer[int, int] = Coalescer(slow, max_batch=16, max_in_flight=4, companions=companions)
        second: Coalescer[int, int] = Coalescer(fast, max_batch=16, max_in_flight=4, companions=companions)

        assert await second.add(1) == 1  # nothing out on `first`: at once
        assert order == ["fast [1]"]
        slow_call = asyncio.create_task(first.add(2))
        await asyncio.sleep(0)
        held = asyncio.create_task(second.add(3))
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["fast [1]", "slow [2]"], "held while the companion's batch is out"
        answer_slow.set()
        assert await slow_call == 2
        assert await asyncio.wait_for(held, 1) == 3
        assert order == ["fast [1]", "slow [2]", "fast [3]"]

    asyncio.run(scenario())
