"""A leader whose lease renewals come too late for its lease says so: real servers count
each lapse (the serving deadline passed before a renewal succeeded, so the shard served
nothing meanwhile) in `shardq_leader_lease_lapses_total`, log it, and time every renewal
in `shardq_lease_renewal_duration_seconds`. Two real causes: the leader's process paused
(SIGSTOP, as a starved or frozen pod), and the lease store itself paused (the real
kube-apiserver SIGSTOPped: it answers late, as an overloaded one does). Before, leaders
that lost their shards this way said nothing. Servers whose renewals were on time count
nothing."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from e2e.kubecluster import ControlPlane
from shardq import Client
from tests.integration.scraping import Samples, leaders_by_shard, samples, scrape_all, scrape_text, values
from tests.support.clusters import LEASE_MS, SERVERS, Cluster, send_once_led
from tests.support.servers import wait_for

pytestmark = pytest.mark.timeout(120)

LAPSES = "shardq_leader_lease_lapses_total"
RENEWALS = "shardq_lease_renewal_duration_seconds_count"
# Past the serving deadline (three quarters of a lease after a renewal's request) and
# past the lease itself: no renewal can be on time. Nobody takes over in these tests.
PAUSE_S = 2 * LEASE_MS / 1000


def scraped(cluster: Cluster, server: str) -> Samples:
    return samples(scrape_text(cluster.metrics_url(server)))


def lapses(cluster: Cluster, server: str, shard: int) -> float:
    return sum(values(scraped(cluster, server), LAPSES, queue="orders", shard=str(shard)))


def renewals(cluster: Cluster, server: str) -> float:
    return sum(values(scraped(cluster, server), RENEWALS))


def leading(cluster: Cluster) -> dict[int, str]:
    """Each shard of `orders` with its leader, once each is led by the lease's holder."""

    def led() -> dict[int, str] | None:
        try:
            flags = leaders_by_shard(scrape_all(cluster))
        except OSError:
            return None  # a server still starting
        holders = {shard: cluster.leader_of(shard).holder for shard in (0, 1)}
        return holders if flags == {str(shard): [holder] for shard, holder in holders.items()} else None

    return wait_for(led, timeout=30, interval=0.2, what="both shards led")


def paused(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_leader_paused_past_its_serving_deadline_counts_one_lapse(cluster: Cluster) -> None:
    leaders = leading(cluster)
    paused_leader, other_leader = leaders[0], leaders[1]
    wait_for(lambda: renewals(cluster, paused_leader) >= 3, timeout=10, what="renewals timed")
    assert all(lapses(cluster, server, shard) == 0 for server in SERVERS for shard in (0, 1))

    paused(cluster.processes[paused_leader].pid)

    wait_for(lambda: lapses(cluster, paused_leader, 0) >= 1, timeout=15, interval=0.2, what="the lapse counted")
    with Client(cluster.endpoint(paused_leader)) as client:
        send_once_led(client, b"after the pause")  # served again: the late renewal took
    assert lapses(cluster, paused_leader, 0) == 1
    assert lapses(cluster, other_leader, 1) == 0, "a leader that was never paused counted a lapse"
    assert "stopped serving" in cluster.log(paused_leader)


def test_leaders_count_a_lapse_when_the_api_server_answers_their_renewals_too_late(
    kubernetes_cluster: Cluster, control_plane: ControlPlane
) -> None:
    cluster = kubernetes_cluster
    leaders = leading(cluster)
    wait_for(lambda: all(renewals(cluster, server) >= 3 for server in leaders.values()), timeout=10, what="renewals")
    assert all(lapses(cluster, server, shard) == 0 for server in SERVERS for shard in (0, 1))
    (api_server,) = [process for process in control_plane.processes if process.name == "kube-apiserver"]

    paused(api_server.popen.pid)

    control_plane.ensure_running()
    for shard, leader in leaders.items():
        wait_for(
            functools.partial(lambda leader, shard: lapses(cluster, leader, shard) >= 1, leader, shard),
            timeout=30,
            interval=0.2,
            what=f"{leader}'s lapse on shard {shard} counted",
        )
        assert "stopped serving" in cluster.log(leader)
    with Client(cluster.endpoint(leaders[0])) as client:
        send_once_led(client, b"after the pause")  # served again once renewals went through
    # One lapse each: the renewal asked for before the pause ended past its own deadline
    # too, and the lapse lasted until one asked for since ended in time.
    assert [lapses(cluster, leader, shard) for shard, leader in leaders.items()] == [1, 1]
    assert lapses(cluster, leaders[0], 1) + lapses(cluster, leaders[1], 0) == 0, "followers count no lapse"


def test_a_leader_counts_its_lapse_while_the_api_server_still_does_not_answer(
    kubernetes_cluster: Cluster, control_plane: ControlPlane
) -> None:
    """An API server that stays down: each renewal times out (the lease store's request
    timeout), none succeeds, and the lapse is counted then, not only once one does."""
    cluster = kubernetes_cluster
    leader = leading(cluster)[0]
    (api_server,) = [process for process in control_plane.processes if process.name == "kube-apiserver"]
    pid = api_server.popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # A renewal's request times out after DEFAULT_REQUEST_TIMEOUT_SECONDS (5 s).
        wait_for(lambda: lapses(cluster, leader, 0) >= 1, timeout=15, interval=0.2, what="the lapse counted")
        during = lapses(cluster, leader, 0)
    finally:
        os.kill(pid, signal.SIGCONT)
    control_plane.ensure_running()
    assert during == 1
    with Client(cluster.endpoint(leader)) as client:
        send_once_led(client, b"after the outage")
    assert lapses(cluster, leader, 0) == 1, "the renewal that ended the lapse counted it again"
