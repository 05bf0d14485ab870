"""Concurrent unary visibility changes from one AsyncClient share requests, as deletes
do, and still answer each caller for its own receipts; one caller's invalid timeout
(the server refuses the whole request for it) fails that caller alone."""

from __future__ import annotations

import asyncio

from shardq import AsyncClient, Message
from shardq.errors import InvalidArgument
from shardq.queues import MAX_RETENTION_MS
from shardq.types import EntryResult, ReceivedMessage
from tests.integration.scraping import samples, scrape_text, values
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "work"
CHANGES = "QueueService/ChangeVisibility"


def change_requests(server: ServerProcess, code: str) -> float:
    # A code no request has ended with yet has no series.
    return sum(values(samples(scrape_text(server.metrics_url)), "shardq_requests_total", method=CHANGES, code=code))


async def claim(client: AsyncClient, count: int) -> list[ReceivedMessage]:
    await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(count)])
    received: list[ReceivedMessage] = []
    while len(received) < count:
        received += await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
    # The first call learns the routes: callers waiting on them resume in no set order.
    (lone,) = await client.change_visibility(QUEUE, [(received[0].receipt, 60_000)])
    assert lone.ok
    return received


def test_concurrent_visibility_changes_share_requests_and_answer_each_caller(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")

    async def scenario() -> tuple[list[list[EntryResult]], float, int]:
        async with AsyncClient(server.endpoint) as client:
            received = await claim(client, 8)
            before = change_requests(server, "OK")
            answers = await asyncio.gather(
                # Seven give their message back at once (timeout 0).
                *(client.change_visibility(QUEUE, [(message.receipt, 0)]) for message in received[1:]),
                client.change_visibility(QUEUE, [("not-a-receipt", 0)]),
            )
            requests = change_requests(server, "OK") - before
            visible = len(await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000))
            return list(answers), requests, visible

    answers, requests, visible = asyncio.run(scenario())
    *given_back, malformed = answers
    assert [[entry.ok for entry in answer] for answer in given_back] == [[True]] * 7
    assert [(entry.ok, entry.reason) for entry in malformed] == [(False, "MALFORMED_RECEIPT")]
    assert visible == 7
    # The first went out alone, at once; the seven made meanwhile went out together.
    assert requests == 2, f"{requests:.0f} visibility requests for 8 concurrent calls"


def test_one_callers_invalid_timeout_fails_that_caller_alone(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")

    async def scenario() -> tuple[list[list[EntryResult] | BaseException], float, float, int]:
        async with AsyncClient(server.endpoint) as client:
            received = await claim(client, 9)
            ok_before = change_requests(server, "OK")
            refused_before = change_requests(server, "INVALID_ARGUMENT")
            answers = await asyncio.gather(
                *(client.change_visibility(QUEUE, [(message.receipt, 0)]) for message in received[1:7]),
                # Longer than any queue may keep a message: the server refuses it.
                client.change_visibility(
                    QUEUE, [(received[7].receipt, 0), (received[8].receipt, MAX_RETENTION_MS + 1)]
                ),
                return_exceptions=True,
            )
            ok = change_requests(server, "OK") - ok_before
            refused = change_requests(server, "INVALID_ARGUMENT") - refused_before
            visible = len(await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000))
            return list(answers), ok, refused, visible

    answers, ok, refused, visible = asyncio.run(scenario())
    *given_back, invalid = answers
    assert all(isinstance(answer, list) and [e.ok for e in answer] == [True] for answer in given_back), given_back
    assert isinstance(invalid, InvalidArgument), repr(invalid)
    assert invalid.field == "changes[1].visibility_timeout_ms", invalid.field  # its own call's index
    # The six came back; the refused call changed nothing (received[7] stays hidden).
    assert visible == 6
    # The first alone; the shared request of the other six was refused; then each went
    # on its own, and the server refused the one with the invalid timeout again.
    assert (ok, refused) == (6, 2), f"{ok:.0f} accepted and {refused:.0f} refused requests"
