"""A restarted server of a replicated cluster reports ready (gRPC health of service "",
what the readiness probe asks) only once every replica it hosts is back in sync, so a
rolling update does not stop the next pod while this one's copies still catch up; and
it reports ready anyway after `--sync-before-ready`, naming the replicas still behind,
so a shard whose leader is gone cannot keep it out of service.

Three real servers (two shards, three replicas each), s3 SIGKILLed until both leaders
drop it from their ISR, then s1 (shard 0's leader) paused with SIGSTOP so that s3 cannot
catch up that shard while it restarts. Leases last a minute: nobody takes over."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardq import Client, Message
from shardq.coordination.fencing import isr_of
from tests.support.clusters import Cluster, running
from tests.support.servers import wait_for

LONG_LEASE_MS = 60_000
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HELD_BACK_S = 3.0


def health(cluster: Cluster, server: str) -> int | None:
    """The server's answer for service "", or None while it does not answer."""
    with grpc.insecure_channel(cluster.endpoint(server)) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError:
            return None
        return int(answer.status)


def in_isr(cluster: Cluster, server: str) -> list[bool]:
    return [server in isr_of(cluster.leader_of(shard)) for shard in range(2)]


def drop_s3_from_both_isrs(cluster: Cluster) -> None:
    """s3 SIGKILLed; writes to both shards until their leaders leave it out of the ISR."""
    wait_for(lambda: health(cluster, "s3") == SERVING, timeout=30, what="s3 ready before the fault")
    cluster.kill("s3")
    with Client(cluster.endpoint("s2"), route_directly=False) as client:

        def dropped() -> bool:
            results = client.send_messages("orders", [Message(f"m{i}".encode()) for i in range(20)])
            assert all(r.ok for r in results), results
            return in_isr(cluster, "s3") == [False, False]

        wait_for(dropped, timeout=30, interval=0.1, what="both leaders dropping s3 from their ISR")


def paused(cluster: Cluster, server: str) -> int:
    pid = cluster.processes[server].pid
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(Cluster(tmp_path / "cluster", lease_ms=LONG_LEASE_MS))


@pytest.mark.timeout(120)
def test_a_restarted_server_waits_for_every_replica_to_be_in_sync_before_it_is_ready(cluster: Cluster) -> None:
    drop_s3_from_both_isrs(cluster)
    leader = paused(cluster, "s1")
    try:
        cluster.start("s3")
        wait_for(lambda: health(cluster, "s3") is not None, timeout=30, what="s3 answering again")
        # Shard 1's leader (s2) takes s3 back; shard 0's (s1, paused) cannot.
        wait_for(lambda: in_isr(cluster, "s3")[1], timeout=30, what="s3 back in shard 1's ISR")
        held_until = time.monotonic() + HELD_BACK_S
        while time.monotonic() < held_until:
            assert health(cluster, "s3") == NOT_SERVING, "ready while shard 0's copy is out of sync"
            time.sleep(0.1)
        assert in_isr(cluster, "s3") == [False, True]
    finally:
        os.kill(leader, signal.SIGCONT)
    wait_for(lambda: health(cluster, "s3") == SERVING, timeout=60, interval=0.05, what="s3 ready after SIGCONT")
    assert in_isr(cluster, "s3") == [True, True], "ready before every replica was back in its ISR"


@pytest.mark.timeout(120)
def test_a_replica_that_cannot_catch_up_delays_readiness_only_as_long_as_allowed(tmp_path: pathlib.Path) -> None:
    allowance = ("--sync-before-ready", "2s")
    with contextlib.contextmanager(running)(
        Cluster(tmp_path / "cluster", lease_ms=LONG_LEASE_MS, server_args=allowance)
    ) as cluster:
        drop_s3_from_both_isrs(cluster)
        leader = paused(cluster, "s1")
        try:
            cluster.start("s3")
            wait_for(lambda: health(cluster, "s3") == SERVING, timeout=30, what="s3 ready after its allowance")
            assert not in_isr(cluster, "s3")[0], "shard 0 caught up although its leader is paused"
            log = (cluster.root / "s3.log").read_text()
            assert "replicas orders.0 are still out of sync after 2 s: reporting ready anyway" in log, log[-3000:]
        finally:
            os.kill(leader, signal.SIGCONT)
