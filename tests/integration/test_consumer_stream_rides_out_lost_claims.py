"""A consumer stream rides out lost claims: the stream goes on, and what a lost claim
took comes back at its visibility timeout, once, to the consumer still reading.

A claim is lost for real when its shard's leadership moves before the claim replicates,
at a moment lease timing decides; the fault tests meet it by chance. Here the real
server loses chosen claims on cue (tests/support/losing_claims.py wraps its receive in
its own process): the second and fifth receives claim and commit as usual and then fail
with OUTCOME_UNKNOWN, the third is refused with NOT_LEADER before it claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import pytest

from shardq import AsyncClient, Message
from tests.support.losing_claims import LOSE_CLAIMS, LOST_BODIES
from tests.support.servers import ServerProcess

LAUNCHER = pathlib.Path(__file__).resolve().parents[1] / "support" / "losing_claims.py"
QUEUE = "claims"
MESSAGES = 20
CREDITS = 4
VISIBILITY_MS = 1_500


async def consume_everything(endpoint: str) -> list[tuple[str, int]]:
    """Every delivery as (body, receive count), each message deleted once taken."""
    deliveries: list[tuple[str, int]] = []
    deleted: set[str] = set()
    async with AsyncClient(endpoint) as client:
        await client.send_messages(QUEUE, [Message(b"%d" % number) for number in range(MESSAGES)])
        async with client.consume(QUEUE, credits=CREDITS, visibility_timeout_ms=VISIBILITY_MS) as stream:
            async for message in stream.messages():
                deliveries.append((message.body.decode(), message.receive_count))
                (outcome,) = await stream.delete([message.receipt])
                assert outcome.ok, outcome
                deleted.add(message.body.decode())
                if len(deleted) == MESSAGES:
                    break
    return deliveries


def test_consumer_stream_rides_out_lost_claims(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lost_bodies = tmp_path / "lost-bodies"
    monkeypatch.setenv(LOSE_CLAIMS, "2:lost,3:not-leader,5:lost")
    monkeypatch.setenv(LOST_BODIES, str(lost_bodies))
    server = dataclasses.replace(ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=2"]), launcher=(str(LAUNCHER),))
    server.start()
    try:
        deliveries = asyncio.run(asyncio.wait_for(consume_everything(server.endpoint), timeout=30))
        assert server.alive()
    finally:
        exit_code = server.stop()
    assert exit_code == 0

    lost = lost_bodies.read_text().split()
    assert len(lost) == 2 * (CREDITS // 2), lost  # each lost claim took the half granted back
    # Each message reached the consumer once: the lost claims' messages only after their
    # visibility timeout (the lost claim counted as their first receive), the rest at once.
    bodies = [body for body, _ in deliveries]
    assert sorted(bodies, key=int) == [str(number) for number in range(MESSAGES)]
    assert dict(deliveries) == {str(number): 2 if str(number) in lost else 1 for number in range(MESSAGES)}
    assert "Traceback" not in server.log()
