"""/metrics says true things about the replica that serves it, and what an on-call needs:
depth summed by queue counts each message once, the leader flag is set on the leader
only, an empty queue's oldest message is 0 seconds old, and requests, refusals, purges,
bytes, streams, leadership changes, replication and limits are all there. promtool
accepts the exposition."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from e2e.binaries import locate_binaries, require
from shardq import AsyncClient, Client, Message
from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.fencing import build_takeover
from shardq.errors import QueueFull
from tests.integration.scraping import leaders_by_shard, samples, scrape_all, scrape_text, value, values
from tests.support.clusters import LEASE_MS, SERVERS, Cluster
from tests.support.servers import ServerFactory, wait_for


def promtool_accepts(text: str) -> None:
    promtool = locate_binaries().promtool
    require(promtool)
    result = subprocess.run(
        [str(promtool), "check", "metrics"], input=text, capture_output=True, text=True, check=False, timeout=30
    )
    assert result.returncode == 0, f"promtool check metrics: {result.stdout}{result.stderr}"


def test_a_standalone_server_exports_what_an_on_call_needs(server_factory: ServerFactory) -> None:
    server = server_factory("orders:shards=2", "limited:max_depth=3,max_message_bytes=1000", "idle", "purged")
    bodies = [b"x" * (10 + n) for n in range(6)]
    with Client(server.endpoint) as client:
        client.send_messages("orders", [Message(body) for body in bodies])
        received = client.receive_messages("orders", max_messages=2, visibility_timeout_ms=60_000)
        client.send_messages("limited", [Message(b"a"), Message(b"b"), Message(b"c")])
        with pytest.raises(QueueFull):
            client.send_messages("limited", [Message(b"one too many")])
        client.send_messages("purged", [Message(b"p1"), Message(b"p2")])
        assert client.purge("purged") == 2
        with pytest.raises(Exception):  # noqa: B017,PT011 - any refusal; the status code is what is checked
            client.receive_messages("no-such-queue", max_messages=1)

    async def scrape_with_a_consumer_open() -> str:
        async with AsyncClient(server.endpoint) as client:
            stream = client.consume("idle", credits=1)
            await stream.__aenter__()
            await asyncio.sleep(0.3)
            text = await asyncio.to_thread(scrape_text, server.metrics_url)
            await stream.close()
            return text

    open_text = asyncio.run(scrape_with_a_consumer_open())
    assert value(samples(open_text), "shardq_open_streams", method="QueueService/ConsumeStream") == 1

    text = scrape_text(server.metrics_url)
    found = samples(text)
    # Depth: each message once; the leader flag on every shard of a standalone server.
    assert sum(values(found, "shardq_messages_visible", queue="orders")) == 4
    assert sum(values(found, "shardq_messages_in_flight", queue="orders")) == 2
    assert values(found, "shardq_shard_leader", queue="orders") == [1.0, 1.0]
    # An empty queue: age 0, and no send-time sample at all (not 1970).
    assert values(found, "shardq_oldest_message_age_seconds", queue="idle") == [0.0]
    assert values(found, "shardq_oldest_message_timestamp_seconds", queue="idle") == []
    ages = values(found, "shardq_oldest_message_age_seconds", queue="orders")
    assert all(0 <= age < 60 for age in ages)
    assert max(ages) > 0
    # Requests by method and status code: the client's sends went on its producer stream,
    # one stream request each, and the refused one by the code a unary call would have had.
    assert value(found, "shardq_stream_requests_total", method="QueueService/SendStream", code="OK") >= 3
    assert (
        value(found, "shardq_stream_requests_total", method="QueueService/SendStream", code="RESOURCE_EXHAUSTED") == 1
    )
    assert value(found, "shardq_requests_total", method="QueueService/SendStream", code="OK") == 1  # it ended
    # The unknown queue: the client's first call (its route lookup) is refused NOT_FOUND.
    assert sum(values(found, "shardq_requests_total", code="NOT_FOUND")) == 1
    # The consumer stream ended (the client went away): counted once, by how it ended.
    assert sum(values(found, "shardq_requests_total", method="QueueService/ConsumeStream")) == 1
    assert value(found, "shardq_open_streams", method="QueueService/ConsumeStream") == 0
    # Refusals, purges, bytes.
    assert sum(values(found, "shardq_messages_refused_total", queue="limited", reason="QUEUE_FULL")) == 1
    assert value(found, "shardq_purges_total", queue="purged") == 1
    assert sum(values(found, "shardq_messages_purged_total", queue="purged")) == 2
    assert sum(values(found, "shardq_message_bytes_in_total", queue="orders")) == sum(len(b) for b in bodies)
    assert sum(values(found, "shardq_message_bytes_out_total", queue="orders")) == sum(len(m.body) for m in received)
    # Build and limits.
    (build,) = [labels for (name, labels), _ in found.items() if name == "shardq_build_info"]
    assert dict(build)["version"]
    assert dict(build)["python"]
    assert value(found, "shardq_queue_max_depth", queue="limited") == 3
    assert value(found, "shardq_queue_max_message_bytes", queue="limited") == 1000
    assert value(found, "shardq_queue_shards", queue="orders") == 2
    # A plaintext server has no certificate: no expiry series, rather than one that looks expired.
    assert values(found, "shardq_tls_certificate_expiration_timestamp_seconds") == []
    assert "shardq_tls_certificate_expiration_timestamp_seconds" not in text
    promtool_accepts(text)


def test_every_commit_reports_how_long_it_took_to_become_durable(server_factory: ServerFactory) -> None:
    """Each shard's commit time histogram counts what its commit counter counts, sends,
    claims and deletes alike, so `rate(_sum) / rate(_count)` is the disk's price per
    commit (group commit folds requests into it; shardq_commit_batch_requests says how many)."""
    server = server_factory("timed:shards=2")
    with Client(server.endpoint) as client:
        for n in range(6):
            client.send_messages("timed", [Message(b"m%d" % n)])
        received = client.receive_messages("timed", max_messages=10, visibility_timeout_ms=60_000)
        client.delete_messages("timed", [message.receipt for message in received])

    def counted() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        # A standalone server answers a batch once its entry is written ahead, and counts
        # the commit when LMDB's commit returns, just after: the last delete's may still
        # be on its way. Every commit is counted by both once they settle.
        found = samples(scrape_text(server.metrics_url))
        settled = all(
            values(found, "shardq_commits_total", queue="timed", shard=shard)
            == values(found, "shardq_commit_duration_seconds_count", queue="timed", shard=shard)
            for shard in ("0", "1")
        )
        return found if settled else None

    found = wait_for(counted, timeout=10, what="every commit counted by the counter and the histogram")
    for shard in ("0", "1"):
        commits = value(found, "shardq_commits_total", queue="timed", shard=shard)
        assert commits >= 3, f"shard {shard}: its three sends commit one by one"
        timed = value(found, "shardq_commit_duration_seconds_count", queue="timed", shard=shard)
        assert timed == commits, f"shard {shard}: {timed} commits timed of {commits}"
        assert value(found, "shardq_commit_duration_seconds_sum", queue="timed", shard=shard) > 0
        everything = value(found, "shardq_commit_duration_seconds_bucket", queue="timed", shard=shard, le="+Inf")
        assert everything == commits
        # One call in flight, nothing waiting for the writer: a standalone server answers
        # each of those sends once its entry is written ahead, before LMDB's commit.
        ahead = value(found, "shardq_commits_written_ahead_total", queue="timed", shard=shard)
        assert 3 <= ahead <= commits, f"shard {shard}: {ahead} of {commits} commits written ahead"


def test_metrics_are_served_at_metrics_only(server_factory: ServerFactory) -> None:
    server = server_factory("orders")
    base = server.metrics_url.removesuffix("/metrics")
    for path in ("/", "/favicon.ico", "/metricsx", "/foo/metrics"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + path, timeout=5)
        refused.value.close()
        assert refused.value.code == 404, path
    assert "shardq_shard_leader" in scrape_text(server.metrics_url)


def test_a_standalone_server_offers_no_replication_service(server_factory: ServerFactory) -> None:
    server = server_factory("orders")
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = replication_pb2_grpc.ReplicationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.timeout(120)
def test_in_a_replicated_cluster_only_leaders_count_and_the_flag_follows_a_failover(cluster: Cluster) -> None:
    with Client(cluster.endpoint("s1")) as client:

        def sent() -> int | None:
            try:
                return len(client.send_messages("orders", [Message(b"m%d" % n) for n in range(20)]))
            except Exception:  # leadership settling at startup
                return None

        total = wait_for(sent, timeout=30, interval=0.5, what="the cluster to accept a send")

    def settled() -> dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]] | None:
        try:
            scraped = scrape_all(cluster)
        except urllib.error.URLError:  # a server still starting (its metrics port not bound yet)
            return None
        leaders = leaders_by_shard(scraped)
        if sorted(leaders) != ["0", "1"] or any(len(holders) != 1 for holders in leaders.values()):
            return None
        return scraped

    scraped = wait_for(settled, timeout=30, interval=0.3, what="one leader flag per shard")
    leaders = leaders_by_shard(scraped)
    assert leaders == {"0": [cluster.leader_of(0).holder], "1": [cluster.leader_of(1).holder]}
    # Summed over every server and shard, each message counts once.
    assert sum(sum(values(found, "shardq_messages_visible", queue="orders")) for found in scraped.values()) == total
    for shard, (leader,) in leaders.items():
        found = scraped[leader]
        assert value(found, "shardq_shard_in_sync_replicas", queue="orders", shard=shard) == 3
        assert len(values(found, "shardq_follower_lag_entries", queue="orders", shard=shard)) == 2
        assert value(found, "shardq_shard_replicas", queue="orders", shard=shard) == 3
        for follower in SERVERS:
            if follower != leader:
                assert values(scraped[follower], "shardq_messages_visible", queue="orders", shard=shard) == []
                assert value(scraped[follower], "shardq_shard_leader", queue="orders", shard=shard) == 0

    # A takeover of shard 0: the flag moves, with the epoch, and the change is counted.
    lease = cluster.leader_of(0)
    new_leader = next(server for server in SERVERS if server != lease.holder)
    cluster.leases.update(
        build_takeover(lease, new_holder=new_leader, now_ms=int(time.time() * 1000), duration_ms=LEASE_MS)
    )

    def moved() -> dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]] | None:
        scraped = scrape_all(cluster)
        return scraped if leaders_by_shard(scraped).get("0") == [new_leader] else None

    scraped = wait_for(moved, timeout=30, interval=0.3, what=f"{new_leader} to carry shard 0's leader flag")
    assert value(scraped[new_leader], "shardq_shard_epoch", queue="orders", shard="0") == lease.transitions + 1
    assert (
        value(scraped[new_leader], "shardq_leadership_changes_total", queue="orders", shard="0", change="acquired") >= 1
    )
    assert (
        value(scraped[lease.holder], "shardq_leadership_changes_total", queue="orders", shard="0", change="lost") >= 1
    )
    assert sum(sum(values(found, "shardq_messages_visible", queue="orders")) for found in scraped.values()) == total
    promtool_accepts(scrape_text(cluster.metrics_url(new_leader)))
