"""While leadership moves, the old leader and the new one may both answer a count for the
same shard; the queue's totals take the newer epoch's, never both."""

from __future__ import annotations

from shard_server.service.queues import one_per_shard
from shardq.api.v1 import queue_pb2


def count(shard: int, epoch: int, visible: int) -> queue_pb2.ShardAttributes:
    return queue_pb2.ShardAttributes(shard=shard, epoch=epoch, visible=visible)


def test_the_newer_epoch_stands_whichever_answered_first() -> None:
    old, new, other = count(1, 3, 40), count(1, 4, 38), count(0, 2, 7)
    for answers in ([old, new, other], [new, old, other], [other, new, old]):
        kept = sorted(one_per_shard(answers), key=lambda a: a.shard)
        assert [(a.shard, a.epoch, a.visible) for a in kept] == [(0, 2, 7), (1, 4, 38)]


def test_distinct_shards_are_all_kept() -> None:
    answers = [count(shard, 1, shard * 10) for shard in range(4)]
    assert sorted(a.visible for a in one_per_shard(answers)) == [0, 10, 20, 30]
