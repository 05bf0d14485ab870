"""What the client claimed for nobody goes back to the queue at once, and one caller's
mistake stays its own, against a real server: a short poll cut off after the server
answered it gives its messages back (it went out alone, from its caller's task, and the
answer was dropped with the messages claimed for their whole visibility timeout); a
wrongly typed message or receipt fails only the caller who passed it, not every caller
sharing its request; and leaving `async with client.consume(...)` gives back the
prefetched messages never taken, unless `close()` handed them to the caller first."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from shardq import AsyncClient, InvalidArgument, Message
from shardq.types import QueueAttributes, ReceivedMessage
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "work"
# Far longer than any test waits: a message still hidden at the end was stranded.
HIDDEN_MS = 60_000


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory(QUEUE)


async def settled_attributes(client: AsyncClient, *, in_flight: int, timeout: float = 3.0) -> QueueAttributes:
    """The queue's attributes once `in_flight` messages are in flight, or when `timeout`
    has passed (claims and give-backs are answered before they are counted)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        attributes = await client.attributes(QUEUE)
        if attributes.in_flight == in_flight or asyncio.get_running_loop().time() >= deadline:
            return attributes
        await asyncio.sleep(0.05)


def test_short_polls_cut_off_after_their_answer_give_their_messages_back(server: ServerProcess) -> None:
    async def scenario() -> tuple[QueueAttributes, int, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%03d" % n) for n in range(100)])
            kept: list[ReceivedMessage] = []
            cut_off = 0
            for attempt in range(20):
                # From 0.2 to 2 ms: some end before the request goes, some while it is out,
                # some after the server answered and before the caller resumed.
                timeout = 0.0002 + attempt * 0.0018 / 19
                receiving = client.receive_messages(QUEUE, max_messages=5, visibility_timeout_ms=HIDDEN_MS)
                try:
                    kept += await asyncio.wait_for(receiving, timeout)
                except TimeoutError:
                    cut_off += 1
            if kept:
                assert all(result.ok for result in await client.delete_messages(QUEUE, [m.receipt for m in kept]))
            return await settled_attributes(client, in_flight=0), len(kept), cut_off

    attributes, deleted, cut_off = asyncio.run(scenario())
    assert cut_off, "no receive was cut off: the test shows nothing"
    assert attributes.in_flight == 0, f"{attributes.in_flight} messages claimed for callers that gave up"
    assert attributes.visible == 100 - deleted


def test_one_callers_wrongly_typed_input_fails_that_caller_alone(server: ServerProcess) -> None:
    not_bytes: Any = "not-bytes"
    not_a_receipt: Any = None

    async def scenario() -> tuple[dict[str, list[Any]], QueueAttributes, list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"to delete %d" % n) for n in range(6)])
            received = await client.receive_messages(QUEUE, max_messages=6, visibility_timeout_ms=HIDDEN_MS)
            assert len(received) == 6
            # The first call of each kind goes out alone; the rest, the bad one among them, share a request.
            outcomes = {
                "delete_messages": await asyncio.gather(
                    *(client.delete_messages(QUEUE, [message.receipt]) for message in received),
                    client.delete_messages(QUEUE, [not_a_receipt]),
                    return_exceptions=True,
                ),
                "send_messages": await asyncio.gather(
                    *(client.send_messages(QUEUE, [Message(b"batch %d" % n)]) for n in range(6)),
                    client.send_messages(QUEUE, [Message(not_bytes)]),
                    return_exceptions=True,
                ),
                "send": await asyncio.gather(
                    *(client.send(QUEUE, b"single %d" % n) for n in range(6)),
                    client.send(QUEUE, not_bytes),
                    return_exceptions=True,
                ),
            }
            attributes = await settled_attributes(client, in_flight=0)
        gc.collect()  # a future failed at close with nobody to retrieve it is reported by now
        return outcomes, attributes, reported

    outcomes, attributes, reported = asyncio.run(scenario())
    failed_for_another = {
        call: sum(isinstance(outcome, BaseException) for outcome in results[:-1]) for call, results in outcomes.items()
    }
    assert failed_for_another == dict.fromkeys(outcomes, 0), f"good calls failed for another's input: {outcomes}"
    # Each bad call gets its own error: a send InvalidArgument naming its message, a delete
    # the TypeError protobuf raised for its receipt.
    expected = {"delete_messages": TypeError, "send_messages": InvalidArgument, "send": InvalidArgument}
    assert {call: type(results[-1]) for call, results in outcomes.items()} == expected, outcomes
    assert all(result.ok for call in ("delete_messages", "send_messages") for r in outcomes[call][:-1] for result in r)
    assert all(result.ok for result in outcomes["send"][:-1])
    # Six deleted, twelve stored, none left claimed by a delete that failed for another's receipt.
    assert (attributes.visible, attributes.in_flight) == (12, 0)
    assert reported == [], [context.get("message") for context in reported]


def test_leaving_a_consumer_stream_gives_back_the_messages_never_taken(server: ServerProcess) -> None:
    async def scenario() -> QueueAttributes:
        async with AsyncClient(server.endpoint) as client:
            for start in range(0, 500, 100):
                await client.send_messages(QUEUE, [Message(b"m%03d" % n) for n in range(start, start + 100)])
            async with client.consume(QUEUE, visibility_timeout_ms=HIDDEN_MS) as stream:
                messages = stream.messages()
                taken = await anext(messages)
                await messages.aclose()
                # The default 400 credits: wait for the rest of the prefetch to arrive.
                deadline = asyncio.get_running_loop().time() + 5
                while len(stream.waiting()) < 399 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                assert len(stream.waiting()) == 399
                assert all(result.ok for result in await stream.delete([taken.receipt]))
            return await settled_attributes(client, in_flight=0)

    attributes = asyncio.run(scenario())
    assert attributes.in_flight == 0, f"{attributes.in_flight} prefetched messages left claimed for nobody"
    assert attributes.visible == 499


def test_messages_a_caller_took_with_close_stay_its_own(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[ReceivedMessage], list[ReceivedMessage], bool]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(10)])
            async with client.consume(QUEUE, credits=10, visibility_timeout_ms=HIDDEN_MS) as stream:
                deadline = asyncio.get_running_loop().time() + 5
                while len(stream.waiting()) < 10 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                kept = await stream.close()
            # Still claimed by this caller: nothing to receive, and its receipts delete.
            others = await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=HIDDEN_MS)
            deleted = all(result.ok for result in await client.delete_messages(QUEUE, [m.receipt for m in kept]))
            return kept, others, deleted

    kept, others, deleted = asyncio.run(scenario())
    assert len(kept) == 10
    assert others == [], "leaving the block gave back what close() had handed to the caller"
    assert deleted
