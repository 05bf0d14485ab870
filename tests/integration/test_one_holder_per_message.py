"""Invariant 1: while a claim is valid, no other receiver gets the same message."""

from __future__ import annotations

import asyncio
from collections import Counter

from shardq import AsyncClient, Message
from tests.support.servers import ServerProcess

QUEUE = "orders"
MESSAGES = 400
RECEIVERS = 12


async def receive_until_empty(client: AsyncClient, seen: list[str]) -> None:
    empty_rounds = 0
    while empty_rounds < 3:
        batch = await client.receive_messages(QUEUE, max_messages=7, visibility_timeout_ms=120_000)
        empty_rounds = 0 if batch else empty_rounds + 1
        seen.extend(m.message_id for m in batch)


async def scenario(endpoint: str) -> tuple[set[str], list[str]]:
    async with AsyncClient(endpoint) as client:
        sent: set[str] = set()
        for start in range(0, MESSAGES, 100):
            results = await client.send_messages(QUEUE, [Message(b"%d" % i) for i in range(start, start + 100)])
            sent.update(r.message_id for r in results)
        seen: list[str] = []
        await asyncio.gather(*(receive_until_empty(client, seen) for _ in range(RECEIVERS)))
        return sent, seen


def test_concurrent_receivers_never_share_a_message(server: ServerProcess) -> None:
    sent, seen = asyncio.run(scenario(server.endpoint))
    doubled = {message_id: n for message_id, n in Counter(seen).items() if n > 1}
    assert not doubled, f"{len(doubled)} messages had two holders at once"
    assert set(seen) == sent
