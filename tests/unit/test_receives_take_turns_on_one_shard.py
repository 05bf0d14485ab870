"""Receives start their claims at one shard for a turn, then at the next: concurrent
consumers claim from the same shard, so their claims and deletes share its commits
(each shard is an LMDB environment: work spread over four shards paid four commits and
four fsyncs), and every shard leads in turn, so none waits while another has plenty.
(Before, each receive started one shard further on: four consumers kept four shards
busy, and a consumer's own claim and delete never shared a commit.)"""

from __future__ import annotations

import asyncio
import itertools
import pathlib

import pytest

from shard_server.domain.messages import NewMessage
from shard_server.domain.receiving import CLAIM_ROTATION_MS, first_shard_to_claim
from shard_server.runtime import hosting
from shard_server.runtime.committing import WriterThreads, wall_clock_ms
from shard_server.runtime.hosting import HostedQueue
from shardq.queues import QueueConfig

SHARDS = 4
CONFIG = QueueConfig(name="orders", shards=SHARDS)


@pytest.mark.parametrize("shards", [1, 4, 7, 400, 1024])
def test_every_shard_leads_once_per_rotation_for_one_stretch(shards: int) -> None:
    start = 1_795_000_000_123
    # One rotation: CLAIM_ROTATION_MS, or a millisecond per shard beyond that many shards.
    rotation_ms = max(CLAIM_ROTATION_MS, shards)
    firsts = [first_shard_to_claim(now, shards) for now in range(start, start + rotation_ms)]
    assert set(firsts) == set(range(shards))
    stretches = 1 + sum(1 for before, after in itertools.pairwise(firsts) if before != after)
    assert stretches <= shards + 1  # one stretch each; the window may cut one in two


def test_receives_in_one_turn_claim_from_one_shard_and_turns_visit_every_shard(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The receive path's clock, moved by the test; ahead of the real one, so every
    # message sent (stamped by the real clock) is visible.
    turn_ms = CLAIM_ROTATION_MS // SHARDS
    now = [(wall_clock_ms() // CLAIM_ROTATION_MS + 1) * CLAIM_ROTATION_MS]
    monkeypatch.setattr(hosting, "wall_clock_ms", lambda: now[0])

    async def scenario() -> None:
        writers = WriterThreads(1)
        queue = HostedQueue(CONFIG, tmp_path / "queue", map_size=1 << 26, writers=writers)
        try:
            for number in range(8 * SHARDS):  # eight messages on every shard
                await queue.send([NewMessage(b"m%d" % number, {}, "", "", 0)], shard=number % SHARDS)
            # Aligned again once all are sent: sends slower than the gap to the first turn's
            # start (a loaded machine) stamped messages after it, and the receive found none.
            now[0] = (wall_clock_ms() // CLAIM_ROTATION_MS + 1) * CLAIM_ROTATION_MS

            async def shard_of_one_receive() -> int:
                answer = await queue.receive(max_messages=1, visibility_timeout_ms=60_000, wait_ms=0)
                ((hosted, _),) = answer.local
                return hosted.index

            # One after another, within a turn: all from the turn's shard.
            one_turn = [await shard_of_one_receive() for _ in range(4)]
            assert one_turn == [one_turn[0]] * 4
            # A turn later each: every shard in turn, though each still holds plenty.
            by_turn = []
            for _ in range(SHARDS):
                now[0] += turn_ms
                by_turn.append(await shard_of_one_receive())
            assert sorted(by_turn) == list(range(SHARDS))
        finally:
            await queue.close()
            writers.shutdown()

    asyncio.run(scenario())
