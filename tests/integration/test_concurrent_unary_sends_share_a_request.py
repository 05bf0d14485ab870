"""Concurrent unary sends from one AsyncClient share requests, and still answer each
caller for its own messages: a lone send goes out at once, small sends made while one is
in flight go out together once it is answered. One caller's invalid message fails that
caller alone (the server refuses the whole shared request, and the client sends its
calls again one by one), sends with dedup ids never share a request with sends without
(a repeat of theirs must store nothing new), large sends go out on their own, a queue
with room for some of the callers stores theirs, and against a cluster each shard's
calls share requests to its leader."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import pytest

from shardq import AsyncClient, Client, Message
from shardq.errors import InvalidArgument, QueueFull
from shardq.types import SendResult
from tests.integration.scraping import samples, scrape_text, values
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "work"
SENDS = "QueueService/SendMessages"
# AsyncClient sends its batches on a producer stream (shardq.send_streams), one stream
# request per request a SendMessages call would have been.
SEND_STREAM = "QueueService/SendStream"


def send_requests(server: ServerProcess, code: str = "OK") -> float:
    """Send requests the server answered with `code`: SendMessages calls and stream batches."""
    found = samples(scrape_text(server.metrics_url))
    # A code no request has ended with yet has no series.
    return sum(values(found, "shardq_requests_total", method=SENDS, code=code)) + sum(
        values(found, "shardq_stream_requests_total", method=SEND_STREAM, code=code)
    )


async def drain(client: AsyncClient, expected: int) -> list[bytes]:
    bodies: list[bytes] = []
    for _ in range(100):
        if len(bodies) >= expected:
            break
        received = await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
        bodies += [message.body for message in received]
    return sorted(bodies)


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory(f"{QUEUE}:shards=2")


def test_concurrent_small_sends_share_requests_and_each_caller_gets_its_own_results(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[list[SendResult]], float, list[bytes]]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"warm-up")])
            before = send_requests(server)
            answers = await asyncio.gather(
                *(client.send_messages(QUEUE, [Message(b"m%d" % n)]) for n in range(7)),
                client.send_messages(QUEUE, [Message(b"m7"), Message(b"m8")]),
            )
            requests = send_requests(server) - before
            return list(answers), requests, await drain(client, 10)

    answers, requests, bodies = asyncio.run(scenario())
    assert [[result.ok for result in answer] for answer in answers] == [[True]] * 7 + [[True, True]]
    ids = [result.message_id for answer in answers for result in answer]
    assert len(set(ids)) == 9
    assert bodies == sorted([b"warm-up"] + [b"m%d" % n for n in range(9)])
    # The first went out alone, at once; the seven made meanwhile went out together.
    assert requests == 2, f"{requests:.0f} send requests for 8 concurrent calls"


def test_a_send_given_up_while_it_waited_to_share_a_request_stores_nothing(server: ServerProcess) -> None:
    """A caller cancelled while its send waits for the request in flight: nothing was sent
    for it, so nothing of it is stored, and the others' sends go out without it."""

    async def scenario() -> tuple[list[list[SendResult]], bool, list[bytes]]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"warm-up")])  # the queue's routes, known
            calls = [asyncio.create_task(client.send_messages(QUEUE, [Message(b"m%d" % n)])) for n in range(4)]
            await asyncio.sleep(0)  # each call is made: the first is out, the rest wait to share
            calls[2].cancel()
            kept = [await call for position, call in enumerate(calls) if position != 2]
            return kept, calls[2].cancelled(), await drain(client, 4)

    kept, cancelled, bodies = asyncio.run(scenario())
    assert cancelled
    assert [[result.ok for result in answer] for answer in kept] == [[True]] * 3
    assert bodies == [b"m0", b"m1", b"m3", b"warm-up"], "the given-up send was stored"


def test_one_callers_invalid_message_fails_that_caller_alone(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[list[SendResult] | BaseException], float, list[bytes]]:
        async with AsyncClient(server.endpoint) as client:
            # Learns the routes first: callers waiting on them resume in no set order.
            await client.send_messages(QUEUE, [Message(b"warm-up")])
            refused_before = send_requests(server, "INVALID_ARGUMENT")
            answers = await asyncio.gather(
                *(client.send_messages(QUEUE, [Message(b"good%d" % n)]) for n in range(5)),
                # Its second message is invalid: attribute keys under "shardq." are the server's.
                client.send_messages(QUEUE, [Message(b"bad0"), Message(b"bad1", {"shardq.reason": "x"})]),
                return_exceptions=True,
            )
            refused = send_requests(server, "INVALID_ARGUMENT") - refused_before
            return list(answers), refused, await drain(client, 6)

    answers, refused, bodies = asyncio.run(scenario())
    *good, bad = answers
    assert all(isinstance(answer, list) and [r.ok for r in answer] == [True] for answer in good), good
    assert isinstance(bad, InvalidArgument), repr(bad)
    # Named as in the caller's own call, not as in the shared request it had joined.
    assert bad.field == "messages[1].attributes", bad.field
    # The others were stored, once each; nothing of the refused call was.
    assert bodies == sorted([b"warm-up"] + [b"good%d" % n for n in range(5)])
    # The shared request was refused, then the refused caller's own request.
    assert refused == 2, f"{refused:.0f} refused requests"


def test_sends_with_dedup_ids_share_requests_only_with_each_other(server: ServerProcess) -> None:
    async def scenario() -> float:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"warm-up")])
            before = send_requests(server)
            hold = asyncio.create_task(client.send_messages(QUEUE, [Message(b"first")]))
            await asyncio.sleep(0)  # in flight: the rest queue behind it
            await asyncio.gather(
                *(client.send_messages(QUEUE, [Message(b"d%d" % n, dedup_id=f"d{n}")]) for n in range(4)),
                *(client.send_messages(QUEUE, [Message(b"p%d" % n)]) for n in range(4)),
                hold,
            )
            return send_requests(server) - before

    requests = asyncio.run(scenario())
    # "first" alone; then the first with a dedup id alone (nothing of its kind was in
    # flight) and the other three together; the four without, together. Had the two
    # kinds shared requests, there would be two.
    assert requests == 4, f"{requests:.0f} send requests"


def test_large_sends_go_out_on_their_own(server: ServerProcess) -> None:
    body = b"x" * (100 * 1024)

    async def scenario() -> tuple[float, int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"warm-up")])
            before = send_requests(server)
            answers = await asyncio.gather(*(client.send_messages(QUEUE, [Message(body)]) for _ in range(4)))
            return send_requests(server) - before, sum(result.ok for answer in answers for result in answer)

    requests, stored = asyncio.run(scenario())
    assert stored == 4
    assert requests == 4, f"{requests:.0f} send requests for 4 large sends"


@pytest.mark.parametrize(
    ("max_depth", "before", "calls"),
    [
        # The shared request (4 calls) fits the queue's depth but not its room: QUEUE_FULL.
        (8, 6, 5),
        # The shared request (7 calls) is longer than the queue's depth: INVALID_ARGUMENT,
        # "a batch of 7 can never fit", for sends of one message each.
        (4, 1, 8),
    ],
)
def test_sends_sharing_a_request_the_queue_has_no_room_for_are_answered_one_by_one(
    server_factory: ServerFactory, max_depth: int, before: int, calls: int
) -> None:
    """A send is stored whole or refused whole when the queue lacks room for all of it.
    Calls sharing a request must not all be refused where some of them, sent alone, fit:
    sent again one by one, as many as there is room for are stored, and the others are
    told the queue is full."""
    server = server_factory(f"{QUEUE}:shards=1,max_depth={max_depth}")

    async def scenario() -> tuple[list[list[SendResult] | BaseException], int]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"before%d" % n) for n in range(before)])
            answers = await asyncio.gather(
                *(client.send_messages(QUEUE, [Message(b"m%d" % n)]) for n in range(calls)), return_exceptions=True
            )
            return list(answers), (await client.attributes(QUEUE)).visible

    answers, visible = asyncio.run(scenario())
    stored = [answer for answer in answers if isinstance(answer, list)]
    refused = [answer for answer in answers if not isinstance(answer, list)]
    room = max_depth - before
    assert [[result.ok for result in answer] for answer in stored] == [[True]] * room, answers
    assert len(refused) == calls - room
    assert all(isinstance(error, QueueFull) for error in refused), refused
    assert visible == max_depth


def test_against_a_cluster_concurrent_sends_share_requests_to_each_shards_leader(tmp_path: pathlib.Path) -> None:
    """Routed straight to the leaders (s1 leads shard 0, s2 shard 1): eight concurrent
    sends take the two shards in turn, and each shard's four reach its leader in two
    requests (the old client sent four to each)."""
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(
            contextlib.contextmanager(running)(Cluster(tmp_path, placement=[["s1", "s2"], ["s2", "s1"]]))
        )
        with Client(cluster.endpoint("s1")) as warm_up:
            send_once_led(warm_up, b"warm-up")
            send_once_led(warm_up, b"warm-up")  # round robin: the other shard too

        def requests(server: str) -> float:
            found = samples(scrape_text(cluster.metrics_url(server)))
            return sum(values(found, "shardq_requests_total", method=SENDS, code="OK")) + sum(
                values(found, "shardq_stream_requests_total", method=SEND_STREAM, code="OK")
            )

        async def scenario() -> dict[str, float]:
            async with AsyncClient(cluster.endpoint("s1")) as client:
                await client.send_messages("orders", [Message(b"learns the routes")])
                before = {server: requests(server) for server in ("s1", "s2")}
                answers = await asyncio.gather(
                    *(client.send_messages("orders", [Message(b"m%d" % n)]) for n in range(8))
                )
                assert [[result.ok for result in answer] for answer in answers] == [[True]] * 8
                assert sorted(result.shard for answer in answers for result in answer) == [0] * 4 + [1] * 4
                return {server: requests(server) - before[server] for server in ("s1", "s2")}

        assert asyncio.run(scenario()) == {"s1": 2, "s2": 2}
