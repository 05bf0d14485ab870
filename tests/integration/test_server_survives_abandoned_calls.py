"""Clients that vanish mid-long-poll or mid-stream do not hurt the server or lose claims."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import grpc

from shardq import AsyncClient, Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.integration.scraping import scraped_total
from tests.support.servers import ServerProcess, drain, stored_count, wait_for

QUEUE = "orders"


async def abandon_calls(endpoint: str) -> None:
    for _ in range(5):
        # A long poll whose caller gives up.
        async with AsyncClient(endpoint) as client:
            poll = asyncio.create_task(client.receive_messages(QUEUE, wait_time_ms=10_000))
            await asyncio.sleep(0.1)
            poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poll
        # A channel closed under a pending long poll.
        client = AsyncClient(endpoint)
        poll = asyncio.create_task(client.receive_messages(QUEUE, wait_time_ms=10_000))
        await asyncio.sleep(0.1)
        await client.close()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await poll
        # Consumer and producer streams cancelled without a goodbye.
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)

            async def consume_requests() -> object:
                yield queue_pb2.ConsumeRequest(start=queue_pb2.ConsumeStart(queue=QUEUE, max_batch=10))
                yield queue_pb2.ConsumeRequest(credits=10)
                await asyncio.sleep(3600)

            consume = stub.ConsumeStream(consume_requests())  # type: ignore[arg-type]
            send = stub.SendStream(iter(()))
            await asyncio.sleep(0.1)
            consume.cancel()
            send.cancel()


def test_server_keeps_serving_after_clients_disappear(server: ServerProcess) -> None:
    asyncio.run(abandon_calls(server.endpoint))
    assert server.alive()
    with Client(server.endpoint) as client:
        sent = client.send_messages(QUEUE, [Message(b"still here %d" % i) for i in range(3)])
        assert stored_count(client, QUEUE) == 3
        assert sorted(m.message_id for m in drain(client, QUEUE)) == sorted(r.message_id for r in sent)


def test_messages_claimed_by_a_vanished_stream_come_back(server: ServerProcess) -> None:
    async def claim_and_vanish() -> int:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages(QUEUE, [Message(b"claimed %d" % i) for i in range(5)])
            stream = client.consume(QUEUE, credits=5, visibility_timeout_ms=500)
            await stream.__aenter__()
            got = 0
            async for _ in stream.messages():
                got += 1
                if got == 5:
                    break
            await stream.close()
            return got

    assert asyncio.run(claim_and_vanish()) == 5
    with Client(server.endpoint) as client:
        returned = client.receive_messages(QUEUE, max_messages=10, wait_time_ms=5_000, visibility_timeout_ms=60_000)
        while len(returned) < 5:
            more = client.receive_messages(QUEUE, max_messages=10, wait_time_ms=5_000, visibility_timeout_ms=60_000)
            assert more, "claimed messages did not come back after their visibility timeout"
            returned += more
        assert sorted(m.body for m in returned) == sorted(b"claimed %d" % i for i in range(5))


KILLED_CLIENT = """
import asyncio, sys
import grpc
from shardq.api.v1 import queue_pb2, queue_pb2_grpc

async def main() -> None:
    channel = grpc.aio.insecure_channel(sys.argv[1])
    stub = queue_pb2_grpc.QueueServiceStub(channel)

    async def consume_requests():
        yield queue_pb2.ConsumeRequest(start=queue_pb2.ConsumeStart(queue="orders", max_batch=1))
        yield queue_pb2.ConsumeRequest(credits=2)
        await asyncio.sleep(3600)

    async def send_requests():
        for n in range(100_000):
            batch = queue_pb2.SendMessagesRequest(queue="orders", messages=[queue_pb2.MessageToSend(body=b"s")])
            yield queue_pb2.SendStreamRequest(request_id=n, batch=batch)
            await asyncio.sleep(0.01)

    async def read(call) -> None:
        async for _ in call:
            pass

    calls = [stub.ConsumeStream(consume_requests()) for _ in range(5)]
    calls += [stub.SendStream(send_requests()) for _ in range(3)]
    readers = [asyncio.create_task(read(call)) for call in calls]
    await asyncio.sleep(1)
    print("open", flush=True)
    await asyncio.gather(*readers)

asyncio.run(main())
"""


def test_streams_of_a_killed_client_are_counted_cancelled_not_ok(server: ServerProcess) -> None:
    """Streams with messages pushed and sends answered when their client is SIGKILLed."""
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"pushed %d" % n) for n in range(20)])

    def counted(method: str, code: str) -> float:
        return scraped_total(server.metrics_url, "shardq_requests_total", method=method, code=code)

    streams = ("QueueService/ConsumeStream", "QueueService/SendStream")
    before = {(method, code): counted(method, code) for method in streams for code in ("OK", "CANCELLED")}
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.endpoint], stdout=subprocess.PIPE)
    try:
        assert client.stdout is not None
        assert client.stdout.readline() == b"open\n"
        wait_for(
            lambda: scraped_total(server.metrics_url, "shardq_open_streams", method=streams[0]) >= 5 or None,
            timeout=10,
            what="the five consume streams to open",
        )
    finally:
        client.kill()
        client.wait()
        if client.stdout is not None:
            client.stdout.close()

    def all_ended() -> bool | None:
        ended = counted(streams[0], "CANCELLED") - before[(streams[0], "CANCELLED")]
        return ended == 5 or None

    wait_for(all_ended, timeout=15, what="the killed client's consume streams to end")
    wait_for(
        lambda: counted(streams[1], "CANCELLED") - before[(streams[1], "CANCELLED")] == 3 or None,
        timeout=15,
        what="the killed client's producer streams to end",
    )
    for method in streams:
        assert counted(method, "OK") == before[(method, "OK")], f"{method}: a killed client's stream counted OK"
