"""Concurrent short polls from one AsyncClient share requests, and each caller still gets
messages of its own: the server claims each caller's share as that caller's own receive
would, in the same commits. Long polls go alone; a FIFO group still goes to one caller at
a time; a shared answer stays within one response however large the messages; against a
cluster, a server with nothing of its own asks the other leader for the whole request;
and a malformed shared request is refused naming its field."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import grpc
import pytest

from shardq import AsyncClient, Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import InvalidArgument, ShardqError
from shardq.queues import MAX_RECEIVE_SHARES
from shardq.status import error_from_rpc
from shardq.types import ReceivedMessage
from tests.integration.scraping import samples, scrape_text, scraped_total, values
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import ServerFactory, ServerProcess, stored_count, wait_for

QUEUE = "work"
RECEIVES = "QueueService/ReceiveMessages"
HIDDEN_MS = 60_000


def receive_requests(metrics_url: str) -> float:
    return sum(values(samples(scrape_text(metrics_url)), "shardq_requests_total", method=RECEIVES, code="OK"))


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory(f"{QUEUE}:shards=2")


def test_concurrent_short_polls_share_requests_and_each_caller_gets_its_own_messages(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[list[ReceivedMessage]], float]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%02d" % n) for n in range(30)])
            before = receive_requests(server.metrics_url)
            answers = await asyncio.gather(
                *(client.receive_messages(QUEUE, max_messages=3, visibility_timeout_ms=HIDDEN_MS) for _ in range(8))
            )
            return list(answers), receive_requests(server.metrics_url) - before

    answers, requests = asyncio.run(scenario())
    assert [len(answer) for answer in answers] == [3] * 8
    bodies = [message.body for answer in answers for message in answer]
    assert len(set(bodies)) == 24, "no message went to two callers"
    # The first went out alone, at once; the seven made meanwhile went out together.
    assert requests == 2, f"{requests:.0f} receive requests for 8 concurrent short polls"


def test_the_shares_of_one_request_are_claimed_in_one_commit(server_factory: ServerFactory) -> None:
    server = server_factory("one:shards=1")
    with Client(server.endpoint) as client:
        client.send_messages("one", [Message(b"m%02d" % n) for n in range(30)])

    def commits() -> float:
        return sum(values(samples(scrape_text(server.metrics_url)), "shardq_commits_total", queue="one"))

    def requests_committed() -> float:
        return scraped_total(server.metrics_url, "shardq_commit_batch_requests_sum", queue="one")

    # The send was answered once written ahead; its commit is counted once LMDB made it.
    before = wait_for(lambda: commits() or None, timeout=10, what="the send's commit counted")
    requests_before = requests_committed()
    with grpc.insecure_channel(server.endpoint) as channel:
        request = queue_pb2.ReceiveMessagesRequest(queue="one", shares=[3] * 8, visibility_timeout_ms=HIDDEN_MS)
        response = queue_pb2_grpc.QueueServiceStub(channel).ReceiveMessages(request, timeout=10)
    assert list(response.share_counts) == [3] * 8
    assert len({message.message_id for message in response.messages}) == 24
    # Messages already durable are handed out before their claim commits, and a send is
    # answered once written ahead, before its own: wait until the claim's commit and the
    # send's (which the writer runs after it) are counted, then check there were two.
    with Client(server.endpoint) as client:
        client.send_messages("one", [Message(b"after")])
    after = wait_for(lambda: (count := commits()) - before >= 2 and count, timeout=10, what="two commits counted")
    assert after - before == 2, "the claim took one commit, the send after it another"
    # And one request each: the shares claim together, not as a request per share.
    assert requests_committed() - requests_before == 2, "the eight shares went to the writer as one request"


def test_long_polls_and_different_visibility_timeouts_do_not_share(server: ServerProcess) -> None:
    async def scenario() -> float:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(4)])
            before = receive_requests(server.metrics_url)
            answers = await asyncio.gather(
                *(client.receive_messages(QUEUE, max_messages=1, wait_time_ms=100) for _ in range(3)),
                client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=HIDDEN_MS),
                client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=HIDDEN_MS + 1),
            )
            assert sum(len(answer) for answer in answers) == 4  # one caller's long poll ends empty
            return receive_requests(server.metrics_url) - before

    # Three long polls, and one short poll for each visibility timeout.
    assert asyncio.run(scenario()) == 5


def test_a_fifo_group_goes_to_one_caller_in_order(server_factory: ServerFactory) -> None:
    server = server_factory("ordered:fifo=true")
    groups = 6

    async def scenario() -> list[list[ReceivedMessage]]:
        async with AsyncClient(server.endpoint) as client:
            for position in range(4):
                await client.send_messages(
                    "ordered",
                    [Message(b"g%d-%d" % (group, position), group_id=f"g{group}") for group in range(groups)],
                )
            answers = await asyncio.gather(
                *(client.receive_messages("ordered", max_messages=3, visibility_timeout_ms=HIDDEN_MS) for _ in range(8))
            )
            return list(answers)

    answers = asyncio.run(scenario())
    owners: dict[str, set[int]] = {}
    for caller, answer in enumerate(answers):
        for message in answer:
            owners.setdefault(message.group_id, set()).add(caller)
        for group in {message.group_id for message in answer}:
            positions = [int(m.body.split(b"-")[1]) for m in answer if m.group_id == group]
            # The group's first messages, in order (its first receiver holds them all).
            assert positions == list(range(len(positions))), f"{group} out of order: {positions}"
    assert owners, "nothing was received"
    assert all(len(callers) == 1 for callers in owners.values()), f"a group went to several callers: {owners}"


def test_a_shared_receive_of_large_messages_fits_one_response(server_factory: ServerFactory) -> None:
    """Sixteen shares of a receive budget of 32 MiB get 2 MiB each: the first share takes
    one 8 MiB message whatever its size, the others none (sixteen would be 128 MiB, past
    gRPC's 64 MiB limit); plain receives then take the rest."""
    server = server_factory("big:max_message_bytes=8MiB")
    body_bytes = 8 * 1024 * 1024 - 64
    with Client(server.endpoint) as client:
        for number in range(3):
            assert client.send_messages("big", [Message(bytes([number]) * body_bytes)])[0].ok
    options = [("grpc.max_receive_message_length", 128 * 1024 * 1024)]
    with grpc.insecure_channel(server.endpoint, options=options) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        request = queue_pb2.ReceiveMessagesRequest(
            queue="big", shares=[10] * MAX_RECEIVE_SHARES, visibility_timeout_ms=HIDDEN_MS
        )
        response = stub.ReceiveMessages(request, timeout=30)
    assert list(response.share_counts) == [1] + [0] * (MAX_RECEIVE_SHARES - 1)
    assert len(response.messages) == 1
    with Client(server.endpoint) as client:
        rest = client.receive_messages("big", max_messages=10, visibility_timeout_ms=HIDDEN_MS)
        received = [*response.messages, *rest]
        assert sorted(message.body[0] for message in received) == [0, 1, 2]
        assert all(result.ok for result in client.delete_messages("big", [m.receipt for m in received]))
        assert stored_count(client, "big") == 0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"shares": [1, 0]}, "shares[1]"),
        ({"shares": [1, 1001]}, "shares[1]"),
        ({"shares": [1] * (MAX_RECEIVE_SHARES + 1)}, "shares"),
        ({"shares": [1, 1], "max_messages": 2}, "max_messages"),
        ({"shares": [1, 1], "wait_time_ms": 100}, "wait_time_ms"),
        ({"shares": [1, 1], "peek": True}, "peek"),
    ],
)
def test_a_malformed_shared_receive_is_refused_naming_its_field(
    server: ServerProcess, fields: dict[str, object], named: str
) -> None:
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"stays")])
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ReceiveMessages(queue_pb2.ReceiveMessagesRequest(queue=QUEUE, **fields), timeout=10)  # type: ignore[arg-type]
    error = error_from_rpc(raised.value, queue=QUEUE)
    assert isinstance(error, InvalidArgument)
    assert error.field == named
    with Client(server.endpoint) as client:
        assert [m.body for m in client.receive_messages(QUEUE, max_messages=10)] == [b"stays"]


def test_against_a_cluster_a_server_with_nothing_asks_the_other_leader_for_the_whole_request(
    tmp_path: pathlib.Path,
) -> None:
    """s1 leads shard 0, s2 shard 1, and only shard 1 holds messages. Through s1 alone
    (not routed to the leaders), the first short poll goes out alone and the three made
    meanwhile share one request: s1 claims nothing of its own and asks s2 for all three."""
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(
            contextlib.contextmanager(running)(Cluster(tmp_path, placement=[["s1", "s2"], ["s2", "s1"]]))
        )
        with Client(cluster.endpoint("s2")) as warm_up:
            send_once_led(warm_up, b"warm-up")
            send_once_led(warm_up, b"warm-up")
            drained = 0
            for _ in range(20):
                drained += len(warm_up.receive_messages("orders", max_messages=10, visibility_timeout_ms=HIDDEN_MS))
            assert drained == 2
        with grpc.insecure_channel(cluster.endpoint("s2")) as channel:
            only_shard_1 = queue_pb2.SendMessagesRequest(
                queue="orders", shard=1, messages=[queue_pb2.MessageToSend(body=b"m%02d" % n) for n in range(20)]
            )
            queue_pb2_grpc.QueueServiceStub(channel).SendMessages(only_shard_1, timeout=10)

        async def scenario() -> tuple[list[list[ReceivedMessage]], float]:
            async with AsyncClient(cluster.endpoint("s1"), route_directly=False) as client:
                before = receive_requests(cluster.metrics_url("s1"))
                answers = await asyncio.gather(
                    *(
                        client.receive_messages("orders", max_messages=3, visibility_timeout_ms=HIDDEN_MS)
                        for _ in range(4)
                    )
                )
                return list(answers), receive_requests(cluster.metrics_url("s1")) - before

        answers, requests = asyncio.run(scenario())
        assert [len(answer) for answer in answers] == [3] * 4
        assert all(message.shard == 1 for answer in answers for message in answer)
        assert len({message.body for answer in answers for message in answer}) == 12
        assert requests == 2


def test_every_caller_of_a_refused_shared_receive_gets_the_error(server: ServerProcess) -> None:
    async def scenario() -> list[list[ReceivedMessage] | BaseException]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m")])
            return list(
                await asyncio.gather(
                    *(client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=-1) for _ in range(4)),
                    return_exceptions=True,
                )
            )

    answers = asyncio.run(scenario())
    assert all(isinstance(answer, InvalidArgument) for answer in answers), answers
    assert all(isinstance(answer, ShardqError) and answer.field == "visibility_timeout_ms" for answer in answers)


def test_messages_of_a_caller_that_gave_up_go_back_to_the_queue_at_once(server: ServerProcess) -> None:
    """A caller cancelled while its share is out: the request goes on for the others, and
    the messages claimed for it are made visible again at once, as the server does for a
    cancelled receive of its own, not after the minute's visibility timeout."""

    async def scenario() -> tuple[list[list[ReceivedMessage]], list[bytes]]:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"m%02d" % n) for n in range(12)])
            calls = [
                asyncio.create_task(client.receive_messages(QUEUE, max_messages=3, visibility_timeout_ms=HIDDEN_MS))
                for _ in range(4)
            ]
            await asyncio.sleep(0)  # each call is made: the first is out, the rest wait to share
            await calls[0]
            for _ in range(3):  # the three waiting calls' shared request goes out
                await asyncio.sleep(0)
            calls[2].cancel()  # while its share is out (a round trip takes ~1 ms)
            kept = [await call for position, call in enumerate(calls) if position != 2]
            assert calls[2].cancelled()
            back: list[bytes] = []
            for _ in range(100):
                back += [
                    m.body
                    for m in await client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=HIDDEN_MS)
                ]
                if back:
                    break
                await asyncio.sleep(0.05)
            return kept, back

    kept, back = asyncio.run(scenario())
    assert [len(answer) for answer in kept] == [3, 3, 3]
    kept_bodies = {message.body for answer in kept for message in answer}
    assert len(back) == 3, f"the cancelled caller's messages did not come back: {back}"
    assert not kept_bodies & set(back)
    assert kept_bodies | set(back) == {b"m%02d" % n for n in range(12)}


def test_shared_receives_cancelled_mid_call_never_take_the_server_down(server: ServerProcess) -> None:
    """Clients that hang up on shared receives at every point of the call: the server
    keeps serving, and every message is still stored (claimed, given back or visible)."""
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"m%03d" % n) for n in range(200)])

    async def hang_up_repeatedly() -> None:
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            for attempt in range(20):  # 120 messages asked at most: some stay visible whatever happens
                call = stub.ReceiveMessages(
                    queue_pb2.ReceiveMessagesRequest(queue=QUEUE, shares=[2, 2, 2], visibility_timeout_ms=HIDDEN_MS)
                )
                await asyncio.sleep(attempt % 4 * 0.0005)  # at once, or a little into the call
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                    await call

    asyncio.run(asyncio.wait_for(hang_up_repeatedly(), timeout=60))
    assert server.process is not None
    assert server.process.poll() is None, "the server died"
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == 200
        assert client.receive_messages(QUEUE, max_messages=1), "the server no longer hands out messages"
