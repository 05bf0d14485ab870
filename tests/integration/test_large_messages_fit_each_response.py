"""A receive of large messages returns as many as fit one response (gRPC caps a
message at 64 MiB) instead of failing the call; the rest stay for later receives."""

from __future__ import annotations

import asyncio

from shardq import AsyncClient, Client, Message
from tests.support.servers import ServerFactory, stored_count

QUEUE = "big"
MESSAGES = 9
# 9 x 8 MiB = 72 MiB: more than one gRPC message may carry.
BODY_BYTES = 8 * 1024 * 1024 - 64


def test_unary_receive_of_large_messages_returns_what_fits(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:max_message_bytes=8MiB")
    with Client(server.endpoint) as client:
        for number in range(MESSAGES):
            result = client.send_messages(QUEUE, [Message(bytes([number]) * BODY_BYTES)])[0]
            assert result.ok, result
        first = client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
        # 32 MiB per receive: four 8 MiB messages, not all nine.
        assert len(first) == 4
        rest = client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
        rest += client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)
        received = first + rest
        assert sorted(message.body[0] for message in received) == list(range(MESSAGES))
        assert all(len(message.body) == BODY_BYTES for message in received)
        results = client.delete_messages(QUEUE, [message.receipt for message in received])
        assert all(result.ok for result in results)
        assert stored_count(client, QUEUE) == 0


def test_consumer_stream_carries_large_messages_in_frames_that_fit(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:max_message_bytes=8MiB")

    async def scenario() -> list[int]:
        async with AsyncClient(server.endpoint) as client:
            for number in range(MESSAGES):
                assert (await client.send_messages(QUEUE, [Message(bytes([number]) * BODY_BYTES)]))[0].ok
            seen: list[int] = []
            async with client.consume(QUEUE, credits=100, max_batch=1000) as stream:
                async for message in stream.messages():
                    seen.append(message.body[0])
                    assert (await stream.delete([message.receipt]))[0].ok
                    if len(seen) == MESSAGES:
                        break
            return seen

    assert sorted(asyncio.run(asyncio.wait_for(scenario(), timeout=60))) == list(range(MESSAGES))
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == 0
