"""Clients that vanish mid-long-poll or mid-stream do not hurt the server or lose claims."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from shardq import AsyncClient, Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from tests.support.servers import ServerProcess, drain, stored_count

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
