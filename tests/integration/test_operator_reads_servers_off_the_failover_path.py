"""The operator's reads of the servers (queue counts, leader reports) never hold up a
reconcile: a paused server accepts the connection and never answers, and while the
reader waits on it the reconcile's side still gets the last figures at once. Once the
server answers again its figures arrive.

A real `shardq serve` process, paused with SIGSTOP as the whole-system test pauses a
leader on the real node (where a pass that read counts from it delayed every failover
past a minute)."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
from collections.abc import Sequence
from typing import Any

from shardq_operator.server_reads import ServerReads, client_tls_of, read_queue_counts
from shardq_operator.statuses import TlsByAddress, leader_reports
from shardq_operator.transport_security import CallTls

from e2e.certificates import issue_serving_certificates
from shardq import Client
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.types import Message
from tests.support.clusters import Cluster
from tests.support.servers import ServerProcess, wait_for

QUEUE = "counted"
CLUSTER = ("ns", "main")


def test_a_paused_server_holds_up_the_reader_but_never_the_reconcile(tmp_path: pathlib.Path) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=2"])
    server.start()
    reading = threading.Event()
    answered: list[dict[str, Any] | None] = []

    def counts_of(
        addresses: Sequence[str], queue: str, credential: PeerCredential, tls: TlsByAddress
    ) -> dict[str, Any] | None:
        reading.set()
        counts = read_queue_counts(addresses, queue, credential, tls)
        answered.append(counts)
        return counts

    reads = ServerReads(every_s=0.2, read_counts=counts_of)
    try:
        with Client(server.endpoint) as client:
            client.send_messages(QUEUE, [Message(body=b"one"), Message(body=b"two")])
        os.kill(server.pid, signal.SIGSTOP)
        reads.want(CLUSTER, addresses=[server.endpoint], queues=[QUEUE])
        assert reading.wait(10), "the reader never started"
        # The reader is now waiting on the paused server; the reconcile's side is not.
        assert reads.queue_counts("ns", QUEUE) == {}
        assert reads.leader_reports(CLUSTER) == {}
        reads.want(CLUSTER, addresses=[server.endpoint], queues=[QUEUE])
        assert answered == [], "a paused server answered"

        os.kill(server.pid, signal.SIGCONT)
        counts = wait_for(lambda: reads.queue_counts("ns", QUEUE) or None, timeout=60, what="the counts after SIGCONT")
        assert counts["visible"] == 2, counts
        assert counts["inFlight"] == 0, counts
    finally:
        reads.stop()
        os.kill(server.pid, signal.SIGCONT)
        server.cleanup()


def test_a_queue_nobody_answers_for_keeps_its_last_figures_a_deleted_one_loses_them() -> None:
    answers: list[dict[str, Any] | None] = [{"visible": 3, "inFlight": 1, "oldestAge": "2s"}, None]
    reads = ServerReads(
        every_s=3600, read_reports=lambda *_: {}, read_counts=lambda *_: answers.pop(0), background=False
    )
    reads.want(CLUSTER, addresses=["127.0.0.1:1"], queues=[QUEUE])
    reads.read_once()
    reads.read_once()
    assert reads.queue_counts("ns", QUEUE) == {"visible": 3, "inFlight": 1, "oldestAge": "2s"}
    reads.want(CLUSTER, addresses=["127.0.0.1:1"], queues=[])  # the Queue was deleted
    assert reads.queue_counts("ns", QUEUE) == {}
    reads.forget(CLUSTER)
    reads.read_once()
    assert answers == [], "a forgotten cluster was read"


def test_a_queue_deleted_while_its_counts_are_read_gets_no_figures_back() -> None:
    reads: ServerReads

    def read_counts(
        addresses: Sequence[str], queue: str, credential: PeerCredential, tls: TlsByAddress
    ) -> dict[str, Any]:
        # The reconcile sees the Queue deleted while this server answers.
        reads.want(CLUSTER, addresses=addresses, queues=[])
        return {"visible": 3, "inFlight": 0, "oldestAge": ""}

    reads = ServerReads(every_s=3600, read_reports=lambda *_: {}, read_counts=read_counts, background=False)
    reads.want(CLUSTER, addresses=["127.0.0.1:1"], queues=[QUEUE])
    reads.read_once()
    assert reads.queue_counts("ns", QUEUE) == {}


def test_the_operators_reads_speak_tls_to_servers_serving_it_checked_for_their_peers_name(
    tmp_path: pathlib.Path,
) -> None:
    """As the operator calls a TLS cluster's pods: by IP, trusting the Secret's CA, checking
    the name each server's peers call it by. (The certificate carries 127.0.0.1 too: these
    servers' peers call each other there.)"""
    certificates = issue_serving_certificates(
        tmp_path / "tls", dns_names=["*.main-shardq-peers.ns.svc.cluster.local"], ip_addresses=["127.0.0.1"]
    )
    tls_args = ("--tls-cert-file", str(certificates.cert), "--tls-key-file", str(certificates.key))
    ca = certificates.ca.read_bytes()
    cluster = Cluster(tmp_path / "cluster", server_args=(*tls_args, "--tls-ca-file", str(certificates.ca)))
    addresses = [cluster.endpoint(server) for server in cluster.servers]
    shards = list(range(len(cluster.placement)))

    def as_peers_name_it(names: dict[str, str] | None = None) -> TlsByAddress:
        return {
            cluster.endpoint(server): client_tls_of(
                CallTls(ca, (names or {}).get(server, f"{server}.main-shardq-peers.ns.svc.cluster.local"))
            )
            for server in cluster.servers
        }

    try:
        for server in cluster.servers:
            cluster.start(server)
        with Client(addresses[0], tls=as_peers_name_it()[addresses[0]], route_directly=False) as client:
            wait_for(
                lambda: len(leader_reports(addresses, NO_PEER_SECRET, as_peers_name_it())) == len(shards) or None,
                timeout=30,
                what="every shard led",
            )
            client.send_messages("orders", [Message(body=b"one")])
        counts = read_queue_counts(addresses, "orders", NO_PEER_SECRET, as_peers_name_it())
        assert counts is not None
        assert counts["visible"] == 1, counts
        reports = leader_reports(addresses, NO_PEER_SECRET, as_peers_name_it())
        assert sorted(shard.index for shard in reports) == shards
        assert sum(report.messages for report in reports.values()) == 1
        # Refused: in plaintext, checked for a name the certificate lacks, trusting another CA.
        assert read_queue_counts(addresses, "orders", NO_PEER_SECRET, {}) is None
        assert leader_reports(addresses, NO_PEER_SECRET) == {}
        misnamed = as_peers_name_it(dict.fromkeys(cluster.servers, "elsewhere.example"))
        assert read_queue_counts(addresses, "orders", NO_PEER_SECRET, misnamed) is None
        assert leader_reports(addresses, NO_PEER_SECRET, misnamed) == {}
        other_ca = issue_serving_certificates(tmp_path / "other", dns_names=["x"], stem="other").ca.read_bytes()
        untrusted = {address: client_tls_of(CallTls(other_ca, "s1.main-shardq-peers.ns.svc.cluster.local"))
                     for address in addresses}  # fmt: skip
        assert leader_reports(addresses, NO_PEER_SECRET, untrusted) == {}
    finally:
        cluster.stop_all()
