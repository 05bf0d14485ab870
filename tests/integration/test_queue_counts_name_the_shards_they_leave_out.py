"""A queue's counts gather the shards led elsewhere from their leaders. When a leader
does not answer (SIGKILLed here, with no takeover yet), the counts leave its shard
out, and now say so: the answer names the uncounted shard, the CLI warns on stderr and
puts it in its JSON, and the operator keeps its last whole figures instead of
publishing low ones. (Before, the totals silently read as fewer messages: the demo
once reported 0 dead-lettered messages of 60.)"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from shardq_operator.server_reads import read_queue_counts

from shardq import Client, ShardqError
from shardq.types import QueueAttributes
from tests.support.clusters import Cluster, running, send_until_accepted
from tests.support.servers import wait_for

# Two shards: s1 leads shard 0, s2 leads shard 1; each holds the other's follower copy.
PLACEMENT = [["s1", "s2"], ["s2", "s1"]]
SENT = 100


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", placement=PLACEMENT))


def whole_counts(client: Client) -> QueueAttributes | None:
    try:
        attributes = client.attributes("orders")
    except ShardqError:
        return None
    return attributes if attributes.complete and attributes.visible == SENT else None


@pytest.mark.timeout(120)
def test_counts_name_a_shard_whose_leader_is_down(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        for start in range(0, SENT, 10):  # batches go round robin over both shards
            send_until_accepted(client, [f"m{start + i}".encode() for i in range(10)], shard_hint="startup")
        before = wait_for(lambda: whole_counts(client), timeout=30, what="every message counted")
        assert before.uncounted_shards == ()
        per_shard = {shard.shard: shard.visible for shard in before.shards}
        assert set(per_shard) == {0, 1}, per_shard
        assert all(per_shard.values()), per_shard
        counts = read_queue_counts([cluster.endpoint("s1")], "orders")
        assert counts is not None
        assert (counts["visible"], counts["inFlight"]) == (SENT, 0), counts

        cluster.kill("s2")
        partial = client.attributes("orders")

    assert partial.uncounted_shards == (1,)
    assert not partial.complete
    assert [shard.shard for shard in partial.shards] == [0]
    assert partial.visible == per_shard[0] < SENT

    stats = subprocess.run(
        [sys.executable, "-m", "shardq", "stats", "--endpoint", cluster.endpoint("s1"), "--queue", "orders", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    summary = json.loads(stats.stdout)
    assert summary["uncounted_shards"] == [1]
    assert summary["shards"] == 2, "the queue's shards, the uncounted one among them"
    assert summary["visible"] == per_shard[0]
    assert "orders: shard(s) 1 not counted" in stats.stderr

    # The operator's status reader skips a partial answer: with no server giving whole
    # counts, the Queue's status keeps the figures it had.
    assert read_queue_counts([cluster.endpoint("s1")], "orders") is None
