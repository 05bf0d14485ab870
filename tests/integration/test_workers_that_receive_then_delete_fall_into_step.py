"""Workers on one AsyncClient that each receive up to 10, then delete each message awaiting
the answer (the consumer loop SQS users write) fall into step: after their first round
every receive and every delete is one request for all of them. Before, the worker whose
first receive went out alone stayed one call ahead of the others for good, and every
round cost two receive requests and an extra delete request, each a commit of its own on
the server."""

from __future__ import annotations

import asyncio

from shardq import AsyncClient, Message
from tests.integration.scraping import samples, scrape_text, values
from tests.support.servers import ServerFactory

QUEUE = "work"
WORKERS = 4
ROUNDS = 5
PER_RECEIVE = 10


def requests(metrics_url: str, method: str) -> float:
    found = samples(scrape_text(metrics_url))
    count = sum(values(found, "shardq_requests_total", method=method, code="OK"))
    if method == "QueueService/DeleteMessages":  # the client's deletes ride an acknowledgement stream
        count += sum(values(found, "shardq_stream_requests_total", method="QueueService/ConsumeStream", code="OK"))
    return count


def test_workers_receiving_then_deleting_each_message_share_every_request_after_their_first(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(f"{QUEUE}:shards=2")
    total = WORKERS * ROUNDS * PER_RECEIVE

    async def scenario() -> tuple[list[int], float, float]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%03d" % n) for n in range(total)])
            receives_before = requests(server.metrics_url, "QueueService/ReceiveMessages")
            deletes_before = requests(server.metrics_url, "QueueService/DeleteMessages")

            async def worker() -> int:
                handled = 0
                while messages := await client.receive_messages(QUEUE, max_messages=PER_RECEIVE):
                    for message in messages:
                        (result,) = await client.delete_messages(QUEUE, [message.receipt])
                        assert result.ok, result
                        handled += 1
                return handled

            handled = await asyncio.gather(*(worker() for _ in range(WORKERS)))
            return (
                list(handled),
                requests(server.metrics_url, "QueueService/ReceiveMessages") - receives_before,
                requests(server.metrics_url, "QueueService/DeleteMessages") - deletes_before,
            )

    handled, receives, deletes = asyncio.run(scenario())
    assert sum(handled) == total
    assert handled == [ROUNDS * PER_RECEIVE] * WORKERS, "each worker got its share"
    # The first receive went out alone and the other three together behind it; from then
    # on one request a round for all four, and one more that found the queue empty.
    assert receives == 2 + (ROUNDS - 1) + 1, f"{receives:.0f} receive requests"
    # The first worker's first delete waited for the others' receive and went out with
    # their deletes: one request per message position per round.
    assert deletes == ROUNDS * PER_RECEIVE, f"{deletes:.0f} delete requests"
