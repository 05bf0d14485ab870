"""A caller of the coalescer gets only what is its own: an answer whose caller gave up goes
to `unwanted` whichever way its call went out (alone or shared, cancelled while out or
after the answer was set and before the caller resumed), and a shared batch that fails
while its request is built from one caller's input is sent again call by call, so only
that caller gets the error. And a request cancelled under its callers cancels them,
rather than leaving them waiting for good."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from shardq.coalescing import Coalescer


def test_a_lone_call_given_up_while_out_still_gets_its_answer_to_unwanted() -> None:
    """The request goes on after its caller is cancelled: awaited in the caller's task, it
    was cancelled with it, and an answer already on its way was dropped."""

    async def scenario() -> None:
        unwanted: list[list[str]] = []
        out = asyncio.Event()
        answer = asyncio.Event()
        finished: list[int] = []

        async def submit(items: list[int]) -> list[str]:
            out.set()
            await answer.wait()
            finished.extend(items)
            return [f"answer {item}" for item in items]

        coalescer: Coalescer[int, str] = Coalescer(submit, max_batch=10, max_in_flight=1, unwanted=unwanted.append)
        caller = asyncio.create_task(coalescer.add(1))
        await out.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert coalescer.sending, "its request is still out"
        answer.set()
        while coalescer.sending:
            await asyncio.sleep(0)
        assert finished == [1], "the request was not cancelled with its caller"
        assert unwanted == [["answer 1"]]
        assert await coalescer.add(2) == "answer 2"

    asyncio.run(scenario())


@pytest.mark.parametrize("callers", [1, 3])
def test_a_caller_cancelled_after_its_answer_was_set_hands_it_to_unwanted(callers: int) -> None:
    """The answer is set, and the caller is cancelled in the loop turn before it would have
    resumed to take it (a short poll under a 1 ms timeout): alone or shared, the answer
    goes to `unwanted`, not nowhere."""

    async def scenario() -> None:
        unwanted: list[list[str]] = []
        calls: list[asyncio.Task[str]] = []
        answer = asyncio.Event()

        async def submit(items: list[int]) -> list[str]:
            await answer.wait()
            if 1 in items:
                # Scheduled before the callers the answer below wakes, so it runs first.
                asyncio.get_running_loop().call_soon(calls[0].cancel)
            return [f"answer {item}" for item in items]

        coalescer: Coalescer[int, str] = Coalescer(submit, max_batch=10, max_in_flight=1, unwanted=unwanted.append)
        # With company, a call out alone first: the others share the batch after it.
        ahead = [asyncio.create_task(coalescer.add(0))] if callers > 1 else []
        for _ in range(3):
            await asyncio.sleep(0)
        calls.extend(asyncio.create_task(coalescer.add(number)) for number in range(1, callers + 1))
        for _ in range(3):
            await asyncio.sleep(0)
        answer.set()
        assert [await call for call in ahead] == ["answer 0"] * len(ahead)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert outcomes[1:] == [f"answer {number}" for number in range(2, callers + 1)]
        assert unwanted == [["answer 1"]]

    asyncio.run(scenario())


@pytest.mark.parametrize("error", [TypeError("expected bytes, str found"), ValueError("Value out of range")])
def test_a_batch_that_fails_on_one_callers_input_is_sent_again_call_by_call(error: Exception) -> None:
    """Building a shared request raised for one caller's value (protobuf raises before
    anything is sent): the others succeed, and that caller alone gets the error, with no
    `alone_on` given (a consumer stream's releases have none)."""

    async def scenario() -> None:
        batches: list[list[object]] = []

        async def submit(items: list[object]) -> list[str]:
            batches.append(items)
            await asyncio.sleep(0)
            if "bad" in items:
                raise error
            return [f"sent {item}" for item in items]

        coalescer: Coalescer[object, str] = Coalescer(submit, max_batch=10, max_in_flight=1)
        outcomes = await asyncio.gather(
            coalescer.add("first"),
            coalescer.add_many(["a", "b"]),
            coalescer.add("bad"),
            coalescer.add("c"),
            return_exceptions=True,
        )
        assert outcomes[:2] == ["sent first", ["sent a", "sent b"]]
        assert outcomes[2] is error
        assert outcomes[3] == "sent c"
        assert batches[:2] == [["first"], ["a", "b", "bad", "c"]]
        assert sorted(map(str, batches[2:])) == sorted(map(str, [["a", "b"], ["bad"], ["c"]]))

    asyncio.run(scenario())


@pytest.mark.parametrize("unwanted", [None, list[list[str]]().append])
def test_callers_of_a_request_cancelled_under_them_are_cancelled_not_left_waiting(
    unwanted: Callable[[list[str]], None] | None,
) -> None:
    """gRPC raises CancelledError from a call whose channel was closed under it: a request
    sent from a task of its own (shared, or alone where answers can be unwanted) passes
    that on to its callers, as a request awaited in the caller's own task did."""

    async def scenario() -> None:
        out = asyncio.Event()

        async def submit(items: list[int]) -> list[str]:
            out.set()
            await asyncio.sleep(0)
            raise asyncio.CancelledError

        coalescer: Coalescer[int, str] = Coalescer(submit, max_batch=10, max_in_flight=1, unwanted=unwanted)
        first = asyncio.create_task(coalescer.add(1))
        await out.wait()
        shared = [asyncio.create_task(coalescer.add(number)) for number in (2, 3)]
        outcomes = await asyncio.wait_for(asyncio.gather(first, *shared, return_exceptions=True), 1)
        assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes), outcomes

    asyncio.run(scenario())
