"""TLS on every port of a server (`--tls-cert-file`, `--tls-key-file`), to peers
(`--tls-ca-file`), with a plaintext health-only port for the kubelet's probe
(`--health-port`), and a certificate that follows its files when they are renewed.

Real servers, real certificates (a throw-away CA from cryptography import x509

from e2e.certificates), real clients:
the library's, the CLI, an HTTPS scraper. The certificate directory is laid out as the
kubelet lays out a mounted Secret (files that are symlinks through `..data`, renewed by
swapping `..data`), so the renewal is the one a cert-manager Secret goes through.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.certificates import ServingCertificates, issue_serving_certificates, not_valid_after
from shardq import Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc, replication_pb2, replication_pb2_grpc
from shardq.coordination.peer_credentials import PEER_SECRET_HEADER, new_peer_secret, write_peer_secret
from shardq.errors import OutcomeUnknown, Unavailable
from shardq.spark.exporting import ExportConnection
from shardq.tls import CA_FILE_ENV, ClientTls
from tests.integration.scraping import samples, scrape_text, value
from tests.support.clusters import Cluster, every_shard_led, running
from tests.support.ports import free_port
from tests.support.servers import ServerProcess, stored_count, wait_for

QUEUE = "orders"
MESSAGES = 40


class MountedSecret:
    """A directory laid out as the kubelet mounts a Secret: `tls.crt`, `tls.key` and
    `ca.crt` are symlinks through `..data`, which a renewal points elsewhere at once."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True)
        self.generation = 0
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (directory / name).symlink_to(f"..data/{name}")

    def publish(self, cert: bytes, key: bytes, ca: bytes) -> None:
        self.generation += 1
        payload = self.directory / f"..generation-{self.generation}"
        payload.mkdir()
        for name, content in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
            (payload / name).write_bytes(content)
        staged = self.directory / "..data_tmp"
        staged.symlink_to(payload.name)
        os.replace(staged, self.directory / "..data")

    def publish_pair(self, certificates: ServingCertificates) -> None:
        self.publish(certificates.cert.read_bytes(), certificates.key.read_bytes(), certificates.ca.read_bytes())

    def path(self, name: str) -> pathlib.Path:
        return self.directory / name

    def server_args(self) -> tuple[str, ...]:
        return (
            "--tls-cert-file", str(self.path("tls.crt")), "--tls-key-file", str(self.path("tls.key")),
            "--tls-ca-file", str(self.path("ca.crt")),
        )  # fmt: skip


def loopback_certificates(directory: pathlib.Path, stem: str, days: int = 2) -> ServingCertificates:
    """A CA and a certificate for the names a loopback server is reached by, valid `days`."""
    return issue_serving_certificates(
        directory,
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        ca_name=f"{stem}-ca",
        stem=stem,
        validity=datetime.timedelta(days=days),
    )


def scraped_expiry(metrics_port: int, ca: pathlib.Path) -> float:
    """The expiry the server's metrics give for the certificate it serves."""
    text = scrape_text(f"https://127.0.0.1:{metrics_port}/metrics", str(ca))
    return value(samples(text), "shardq_tls_certificate_expiration_timestamp_seconds")


def tls_to(ca: pathlib.Path, server_name: str | None = None) -> ClientTls:
    return ClientTls.from_ca_file(ca, server_name)


def round_trip(client: Client, body: bytes) -> None:
    """Send one message, receive it back and delete it."""
    client.send(QUEUE, body)
    received = client.receive_messages(QUEUE, max_messages=10, wait_time_ms=2_000)
    assert [message.body for message in received] == [body]
    assert all(result.ok for result in client.delete_messages(QUEUE, [message.receipt for message in received]))


def refused(client_tls: ClientTls | bool, endpoint: str) -> str:
    """What a client with `client_tls` is told when it calls `endpoint`."""
    with pytest.raises(Unavailable) as failure, Client(endpoint, tls=client_tls, route_directly=False) as client:
        client.send(QUEUE, b"refused")
    return str(failure.value)


def presented_issuer(port: int) -> str:
    """The issuer of the certificate a new TLS connection to `port` is shown."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10)) as secured:
        der = secured.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).issuer.rfc4514_string()


@pytest.fixture
def secret_dir(tmp_path: pathlib.Path) -> MountedSecret:
    mounted = MountedSecret(tmp_path / "tls")
    mounted.publish_pair(loopback_certificates(tmp_path / "issued", "first"))
    return mounted


@pytest.fixture
def health_port() -> int:
    return free_port()


@pytest.fixture
def tls_server(tmp_path: pathlib.Path, secret_dir: MountedSecret, health_port: int) -> Iterator[ServerProcess]:
    (tmp_path / "server").mkdir()
    arguments = (*secret_dir.server_args(), "--health-port", str(health_port))
    server = ServerProcess.in_directory(tmp_path / "server", [QUEUE], *arguments)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.mark.timeout(120)
def test_a_tls_server_serves_only_clients_that_trust_its_certificate(
    tls_server: ServerProcess, secret_dir: MountedSecret, tmp_path: pathlib.Path, health_port: int
) -> None:
    ca = secret_dir.path("ca.crt")
    with Client(tls_server.endpoint, tls=tls_to(ca)) as trusting:
        round_trip(trusting, b"over tls")
        # By another name the certificate carries, checked against that name.
        with Client(f"localhost:{tls_server.port}", ca_file=ca) as by_name:
            round_trip(by_name, b"by name")
        with Client(tls_server.endpoint, tls=tls_to(ca, server_name="localhost")) as renamed:
            round_trip(renamed, b"renamed")

        # A plaintext client, one trusting another CA, one checking a name the
        # certificate does not carry: none reaches the queue.
        assert "Socket closed" in refused(False, tls_server.endpoint)
        stranger = loopback_certificates(tmp_path / "stranger", "stranger")
        assert "CERTIFICATE_VERIFY_FAILED" in refused(tls_to(stranger.ca), tls_server.endpoint)
        assert "Hostname Verification" in refused(tls_to(ca, "elsewhere.example"), tls_server.endpoint)
        assert stored_count(trusting, QUEUE) == 0
        round_trip(trusting, b"still serving")

    # The metrics port serves the same certificate, and nothing in plaintext; it says when
    # the certificate expires.
    metrics_url = f"https://127.0.0.1:{tls_server.metrics_port}/metrics"
    assert "shardq_messages_sent_total" in scrape_text(metrics_url, str(ca))
    assert scraped_expiry(tls_server.metrics_port, ca) == not_valid_after(secret_dir.path("tls.crt"))
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape_text(f"http://127.0.0.1:{tls_server.metrics_port}/metrics")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape_text(metrics_url, str(stranger.ca))

    # The health port is plaintext, says what the main port's health says, and serves
    # nothing else.
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
        answer = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as other:
            queue_pb2_grpc.QueueServiceStub(plain).ListQueues(queue_pb2.ListQueuesRequest(), timeout=5)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert tls_server.alive()


@pytest.mark.timeout(120)
def test_the_cli_speaks_tls_and_says_what_is_wrong_when_it_cannot(
    tls_server: ServerProcess, secret_dir: MountedSecret, tmp_path: pathlib.Path
) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "shardq", *args, "--endpoint", tls_server.endpoint]
        environment = {key: value for key, value in os.environ.items() if not key.startswith("SHARDQ_")}
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=environment)

    ca = str(secret_dir.path("ca.crt"))
    sent = cli("send", "--queue", QUEUE, "--body", "from the cli", "--ca-file", ca)
    assert sent.returncode == 0, sent.stderr
    received = cli("receive", "--queue", QUEUE, "--max", "5", "--ca-file", ca)
    assert received.returncode == 0, received.stderr
    assert "from the cli" in received.stdout

    plaintext = cli("send", "--queue", QUEUE, "--body", "x")
    assert plaintext.returncode == 1
    assert "if it serves TLS, give --ca-file" in plaintext.stderr
    stranger = loopback_certificates(tmp_path / "stranger", "stranger")
    untrusted = cli("send", "--queue", QUEUE, "--body", "x", "--ca-file", str(stranger.ca))
    assert untrusted.returncode == 1
    assert f"TLS certificate is not signed by a CA in {stranger.ca}" in untrusted.stderr
    misnamed = cli("send", "--queue", QUEUE, "--body", "x", "--ca-file", ca, "--tls-server-name", "elsewhere.example")
    assert misnamed.returncode == 1
    assert "does not carry the name 'elsewhere.example'" in misnamed.stderr
    unreadable = cli("send", "--queue", QUEUE, "--body", "x", "--ca-file", str(tmp_path / "absent.crt"))
    assert unreadable.returncode == 1
    assert "cannot read the CA file" in unreadable.stderr
    for failed in (plaintext, untrusted, misnamed, unreadable):
        # One line: no traceback, and none of gRPC's own log lines about the handshake.
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    with Client(tls_server.endpoint, ca_file=ca) as client:
        assert stored_count(client, QUEUE) == 1  # the one the refused calls did not add to


@pytest.mark.timeout(120)
def test_a_renewed_certificate_is_served_to_new_connections_and_a_broken_one_is_not(
    tls_server: ServerProcess, secret_dir: MountedSecret, tmp_path: pathlib.Path
) -> None:
    first_ca = tmp_path / "first-ca.crt"
    shutil.copy(secret_dir.path("ca.crt"), first_ca)
    with Client(tls_server.endpoint, ca_file=first_ca) as before:
        round_trip(before, b"before the renewal")
        assert "first-ca" in presented_issuer(tls_server.port)
        first_expiry = scraped_expiry(tls_server.metrics_port, first_ca)
        assert first_expiry == not_valid_after(secret_dir.path("tls.crt"))

        renewed = loopback_certificates(tmp_path / "issued", "renewed", days=3)
        secret_dir.publish_pair(renewed)
        # New connections get the renewed certificate, on both ports.
        with Client(tls_server.endpoint, ca_file=renewed.ca) as after:
            round_trip(after, b"after the renewal")
        assert "renewed-ca" in presented_issuer(tls_server.port)
        assert "shardq_messages_sent_total" in scrape_text(
            f"https://127.0.0.1:{tls_server.metrics_port}/metrics", str(renewed.ca)
        )
        # The expiry follows: a day later than the first certificate's.
        assert scraped_expiry(tls_server.metrics_port, renewed.ca) == not_valid_after(renewed.cert) > first_expiry
        assert "CERTIFICATE_VERIFY_FAILED" in refused(tls_to(first_ca), tls_server.endpoint)
        # A connection made before goes on as it was.
        round_trip(before, b"on the old connection")

    # A key that is not the certificate's (written out of step): the last good pair serves.
    mismatched = loopback_certificates(tmp_path / "issued", "mismatched", days=4)
    secret_dir.publish(mismatched.cert.read_bytes(), renewed.key.read_bytes(), mismatched.ca.read_bytes())
    with Client(tls_server.endpoint, ca_file=renewed.ca) as still:
        round_trip(still, b"with the last good pair")
    assert "renewed-ca" in presented_issuer(tls_server.port)
    wait_for(lambda: "do not load" in tls_server.log() or None, timeout=10, what="the refused pair logged")
    # The expiry is the served certificate's, not the new file's: an expiry alert still
    # sees the renewal as not done.
    assert scraped_expiry(tls_server.metrics_port, renewed.ca) == not_valid_after(renewed.cert)
    # Once the pair is whole, it is served.
    secret_dir.publish_pair(mismatched)
    with Client(tls_server.endpoint, ca_file=mismatched.ca) as mended:
        round_trip(mended, b"with the mended pair")
    assert scraped_expiry(tls_server.metrics_port, mismatched.ca) == not_valid_after(mismatched.cert)
    assert tls_server.alive()


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        (("--tls-cert-file", "{cert}"), "--tls-cert-file and --tls-key-file go together"),
        (("--tls-ca-file", "{ca}"), "--tls-ca-file goes with --tls-cert-file and --tls-key-file"),
        (
            ("--tls-cert-file", "{cert}", "--tls-key-file", "{other_key}"),
            "{other_key} is not the private key of {cert}",
        ),
        (("--tls-cert-file", "{cert}", "--tls-key-file", "{absent}"), "cannot read {absent}"),
        (
            ("--tls-cert-file", "{cert}", "--tls-key-file", "{key}", "--tls-ca-file", "{key}"),
            "holds no PEM certificate",
        ),
    ],
)
def test_a_server_refuses_to_start_with_tls_files_it_cannot_use(
    tmp_path: pathlib.Path, arguments: tuple[str, ...], complaint: str
) -> None:
    issued = loopback_certificates(tmp_path / "issued", "server")
    other = loopback_certificates(tmp_path / "issued", "other")
    names = {
        "cert": str(issued.cert), "key": str(issued.key), "ca": str(issued.ca),
        "other_key": str(other.key), "absent": str(tmp_path / "absent.key"),
    }  # fmt: skip
    command = [
        sys.executable, "-m", "shardq", "serve", "--data-dir", str(tmp_path / "data"), "--queue", QUEUE,
        "--port", "0", *(argument.format(**names) for argument in arguments),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode != 0
    assert complaint.format(**names) in finished.stderr
    assert "Traceback" not in finished.stderr


@pytest.fixture
def tls_cluster(tmp_path: pathlib.Path, secret_dir: MountedSecret) -> Iterator[Cluster]:
    write_peer_secret(tmp_path / "peer-secret", new_peer_secret())
    yield from running(
        Cluster(
            tmp_path / "cluster",
            lease_ms=60_000,
            spare_servers=("s4",),
            server_args=("--peer-secret-file", str(tmp_path / "peer-secret"), *secret_dir.server_args()),
        )
    )


@pytest.mark.timeout(180)
def test_a_tls_cluster_replicates_and_forwards_over_tls_and_its_servers_check_each_other(
    tls_cluster: Cluster, secret_dir: MountedSecret, tmp_path: pathlib.Path
) -> None:
    ca = secret_dir.path("ca.crt")
    credentials = grpc.ssl_channel_credentials(ca.read_bytes())
    with grpc.secure_channel(tls_cluster.endpoint("s4"), credentials) as through_s4:
        wait_for(
            lambda: every_shard_led(queue_pb2_grpc.QueueServiceStub(through_s4), shards=2),
            timeout=30,
            what="every shard led",
        )
    bodies = [f"message {number}".encode() for number in range(MESSAGES)]
    # s4 holds no replica: everything it is sent goes to the leaders, over TLS.
    with Client(tls_cluster.endpoint("s4"), ca_file=ca, route_directly=False) as forwarded:
        forwarded.send_messages(QUEUE, [Message(body=body) for body in bodies[:20]])
    # Straight to the leaders, at the addresses the map gives, over TLS too.
    with Client(tls_cluster.endpoint("s1"), ca_file=ca) as direct:
        direct.send_messages(QUEUE, [Message(body=body) for body in bodies[20:]])
        # Every server holds every entry of both shards: copied over TLS.
        secret = (tmp_path / "peer-secret").read_text().strip()
        wait_for(
            lambda: _copied_everywhere(tls_cluster, credentials, secret),
            timeout=20,
            what="every message on every replica",
        )
        received: list[bytes] = []
        for _ in range(20):
            received += [message.body for message in direct.receive_messages(QUEUE, max_messages=10, wait_time_ms=500)]
            if len(received) >= len(bodies):
                break
        assert sorted(received) == sorted(bodies)

    # s4 again, now checking its peers against a CA that did not sign them: it cannot
    # forward, and says the certificate is why.
    stranger = loopback_certificates(tmp_path / "stranger", "stranger")
    tls_cluster.kill("s4")
    tls_cluster.server_args = tuple(
        str(stranger.ca) if argument == str(ca) else argument for argument in tls_cluster.server_args
    )
    tls_cluster.start("s4")
    with Client(tls_cluster.endpoint("s4"), ca_file=ca, route_directly=False) as suspicious:
        wait_for(lambda: _answers(suspicious), timeout=30, what="s4 serving")
        # The stream's UNAVAILABLE answer reads as "may or may not": s4 cannot tell the
        # client more than the transport told it.
        with pytest.raises((Unavailable, OutcomeUnknown), match="CERTIFICATE_VERIFY_FAILED"):
            suspicious.send(QUEUE, b"never forwarded")
    said = [line for line in tls_cluster.log("s4").splitlines() if "cannot reach peer" in line]
    assert len(said) == 1, said  # once a minute, not once per call
    assert "over TLS (check --tls-ca-file" in said[0]
    assert "CERTIFICATE_VERIFY_FAILED" in said[0]
    with Client(tls_cluster.endpoint("s1"), ca_file=ca) as direct:
        assert stored_count(direct, QUEUE) == MESSAGES


def _copied_everywhere(cluster: Cluster, credentials: grpc.ChannelCredentials, secret: str) -> bool | None:
    """Whether s1, s2 and s3 each hold all 40 messages (asked over TLS, with the secret)."""
    for server in ("s1", "s2", "s3"):
        with grpc.secure_channel(cluster.endpoint(server), credentials) as channel:
            answer = replication_pb2_grpc.ReplicationServiceStub(channel).GetReplicaStatus(
                replication_pb2.GetReplicaStatusRequest(), metadata=((PEER_SECRET_HEADER, secret),), timeout=5
            )
        if sum(replica.messages for replica in answer.replicas if replica.queue == QUEUE) != MESSAGES:
            return None
    return True


def _answers(client: Client) -> bool | None:
    try:
        client.list_queues()
    except Unavailable:
        return None
    return True


@pytest.mark.timeout(120)
def test_the_spark_sources_connection_reads_over_tls_with_the_ca_the_environment_names(
    tls_server: ServerProcess, secret_dir: MountedSecret, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = secret_dir.path("ca.crt")
    with Client(tls_server.endpoint, ca_file=ca) as client:
        sent = {result.message_id for result in client.send_messages(QUEUE, [Message(b"a"), Message(b"b")])}

    def exported() -> set[str]:
        with ExportConnection(tls_server.endpoint, rpc_timeout_seconds=5, retry_seconds=2) as connection:
            batches = connection.message_batches(queue=QUEUE, shard=0, include_body=False, batch_size=100)
            return {message.message_id for batch in batches for message in batch.messages}

    monkeypatch.setenv(CA_FILE_ENV, str(ca))  # what spark.executorEnv.SHARDQ_CA_FILE sets
    assert exported() == sent
    monkeypatch.delenv(CA_FILE_ENV)
    with pytest.raises(Unavailable):
        exported()
