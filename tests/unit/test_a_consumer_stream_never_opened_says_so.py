"""Taking messages from a consumer stream that was never opened (`client.consume(q)`
without `async with`) raises at once, saying how to open it: it waited for good, as
nothing would ever arrive. No server is needed to see it: nothing is sent."""

from __future__ import annotations

import asyncio

import pytest

from shardq import AsyncClient


def test_messages_of_a_stream_never_opened_raise_at_once() -> None:
    async def scenario() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            stream = client.consume("orders")
            with pytest.raises(RuntimeError, match=r"async with client\.consume"):
                await asyncio.wait_for(anext(stream.messages()), 5)

    asyncio.run(scenario())
