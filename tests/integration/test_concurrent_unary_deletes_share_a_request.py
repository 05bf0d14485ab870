"""Concurrent deletes from one AsyncClient share requests, and still answer each
caller for its own receipts: a lone delete goes out at once, deletes made while one is
in flight go out together once it is answered, and one caller's malformed receipt is
that caller's result alone, never a failure of the others' deletes. The requests are
acknowledgement frames on the client's acknowledgement stream (shardq.ack_streams), not
DeleteMessages calls."""

from __future__ import annotations

import asyncio

from shardq import AsyncClient, Message
from shardq.types import EntryResult
from tests.integration.scraping import samples, scrape_text, value, values
from tests.support.servers import ServerFactory

QUEUE = "work"
DELETES = "QueueService/DeleteMessages"


def delete_requests(metrics_url: str) -> tuple[float, float]:
    """Acknowledgement frames answered, and DeleteMessages calls answered."""
    found = samples(scrape_text(metrics_url))
    return (
        value(found, "shardq_stream_requests_total", method="QueueService/ConsumeStream", code="OK"),
        sum(values(found, "shardq_requests_total", method=DELETES)),
    )


def test_concurrent_unary_deletes_share_requests_and_answer_each_caller(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:shards=2")

    async def scenario() -> tuple[list[list[EntryResult]], int, float, float]:
        # Straight to the one server: its leaders are all the endpoint.
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(9)])
            received = []
            while len(received) < 9:
                received += await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
            lone = await client.delete_messages(QUEUE, [received[0].receipt])
            assert [entry.ok for entry in lone] == [True]
            before = delete_requests(server.metrics_url)
            # Eight callers at once, one with a receipt that is not one.
            answers = await asyncio.gather(
                *(client.delete_messages(QUEUE, [message.receipt]) for message in received[1:8]),
                client.delete_messages(QUEUE, ["not-a-receipt", received[8].receipt]),
            )
            after = delete_requests(server.metrics_url)
            left = (await client.attributes(QUEUE)).in_flight
            return list(answers), left, after[0] - before[0], after[1] - before[1]

    answers, left, requests, unary_calls = asyncio.run(scenario())
    assert [[entry.ok for entry in answer] for answer in answers[:7]] == [[True]] * 7
    malformed, last = answers[7]
    assert (malformed.ok, malformed.reason) == (False, "MALFORMED_RECEIPT")
    assert last.ok
    assert left == 0
    # The first went out alone, at once; the seven made meanwhile went out together.
    assert requests == 2, f"{requests:.0f} delete requests for 8 concurrent calls"
    assert unary_calls == 0, "the deletes went out as unary calls, not on the acknowledgement stream"
