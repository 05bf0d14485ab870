"""Client authentication and per-queue authorisation against a real kube-apiserver.

Real ServiceAccounts, real tokens from the TokenRequest API, real Roles and
RoleBindings; real `shardq serve` processes started with `--client-auth kubernetes`,
which ask the API server (TokenReview, SubjectAccessReview) about every caller. Each
refusal is checked for its status, its reason and its words, and after every refusal
the stored messages are checked to be exactly those that were accepted.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from kubernetes import client

from e2e.queue_rights import EVERY_VERB, account_token, grant
from shardq import Client, Message
from shardq.aio import AsyncClient
from shardq.api.v1 import export_pb2, export_pb2_grpc, queue_pb2, queue_pb2_grpc
from shardq.bearer_tokens import TOKEN_FILE_ENV, BearerToken, with_token
from shardq.coordination.peer_credentials import new_peer_secret, write_peer_secret
from shardq.errors import PermissionDenied, Reason, Unauthenticated, Unavailable
from shardq.status import error_from_rpc
from tests.support.clusters import Cluster, every_shard_led
from tests.support.ports import free_port
from tests.support.servers import ServerProcess, drain, wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]

AUDIENCE = "shardq"
QUEUES = ("orders", "audit")


class Accounts:
    """producer: send to orders. worker: receive from orders. analyst: export orders.
    stranger: nothing. admin: every verb on every queue."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        core = client.CoreV1Api(api)
        for account in ("producer", "worker", "analyst", "stranger", "admin"):
            core.create_namespaced_service_account(
                namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=account))
            )
        grant(api, namespace, "producer", queue="orders", verbs=["send"])
        grant(api, namespace, "worker", queue="orders", verbs=["receive"])
        grant(api, namespace, "analyst", queue="orders", verbs=["export"])
        grant(api, namespace, "admin", queue=None, verbs=EVERY_VERB)
        self.api = api
        self.namespace = namespace
        self.tokens = {
            account: account_token(api, namespace, account, audiences=[AUDIENCE])
            for account in ("producer", "worker", "analyst", "stranger", "admin")
        }
        # The same account's token for the API server: it must never pass as a shardq one.
        self.apiserver_token = account_token(api, namespace, "admin", audiences=None)


@pytest.fixture
def accounts(api_client: client.ApiClient, namespace: str) -> Accounts:
    return Accounts(api_client, namespace)


def authenticating_server(
    directory: pathlib.Path, queues: list[str], *, kubeconfig: pathlib.Path, namespace: str
) -> ServerProcess:
    """A standalone server (not started) that asks the API server `kubeconfig` names."""
    return ServerProcess.in_directory(
        directory,
        queues,
        *("--client-auth", "kubernetes", "--kubeconfig", str(kubeconfig), "--namespace", namespace),
    )


@pytest.fixture
def server(tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str) -> Iterator[ServerProcess]:
    process = authenticating_server(tmp_path, ["orders:shards=2", "audit"], kubeconfig=kubeconfig, namespace=namespace)
    process.start()
    try:
        yield process
    finally:
        process.cleanup()


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def error_info_reason(error: grpc.RpcError) -> str:
    return error_from_rpc(error).reason.value


def stored(server: ServerProcess, accounts: Accounts, queue: str) -> list[bytes]:
    with Client(server.endpoint, token=accounts.tokens["admin"]) as admin:
        return sorted(message.body for message in drain(admin, queue))


def test_calls_without_a_token_the_cluster_accepts_are_refused_unauthenticated(
    server: ServerProcess, accounts: Accounts
) -> None:
    channel = grpc.insecure_channel(server.endpoint)
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    send = queue_pb2.SendMessagesRequest(queue="orders", messages=[queue_pb2.MessageToSend(body=b"x")])
    cases = {
        "no token": (),
        "not bearer": (("authorization", f"Basic {accounts.tokens['producer']}"),),
        "empty": (("authorization", "Bearer "),),
        "garbage": (("authorization", "Bearer not-a-token"),),
        "the API server's audience": (("authorization", f"Bearer {accounts.apiserver_token}"),),
        # Past the server's bound, below the 8 KiB where gRPC starts refusing metadata itself.
        "far too long": (("authorization", "Bearer " + "a" * 5_000),),
    }
    for case, metadata in cases.items():
        error = refused(lambda metadata=metadata: stub.SendMessages(send, metadata=metadata, timeout=10))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED, case
        assert error_info_reason(error) == Reason.UNAUTHENTICATED.value, case
        # Never echoed back: a refusal must not hand the token to whoever reads logs.
        assert accounts.apiserver_token not in (error.details() or ""), case
    no_token = refused(lambda: stub.SendMessages(send, timeout=10))
    assert "authorization: Bearer" in (no_token.details() or "")
    garbage = refused(lambda: stub.SendMessages(send, metadata=cases["garbage"], timeout=10))
    assert "does not accept this token" in (garbage.details() or "")
    # Health stays open: the kubelet's probe carries no token.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    assert server.alive()
    assert stored(server, accounts, "orders") == []


def test_each_account_may_do_only_what_its_role_grants_on_each_queue(server: ServerProcess, accounts: Accounts) -> None:
    with Client(server.endpoint, token=accounts.tokens["producer"]) as producer:
        producer.send_messages("orders", [Message(b"one"), Message(b"two")])
        producer.send("orders", b"three")  # over the producer stream
        with pytest.raises(PermissionDenied) as denied:
            producer.send_messages("audit", [Message(b"nope")])
        # The client learns the queue's shards first: refused there, naming every verb that
        # would have let it.
        assert "may not get or send or receive on queue 'audit'" in denied.value.message
        assert "system:serviceaccount:" in denied.value.message
        with pytest.raises(PermissionDenied) as denied:
            producer.receive_messages("orders", max_messages=10)
        assert "may not receive on queue 'orders'" in denied.value.message
        with pytest.raises(PermissionDenied):
            producer.purge("orders")
        with pytest.raises(PermissionDenied):
            producer.list_queues()
        # One stream carries a client's sends to every queue: the refused batch is
        # answered alone, and the stream goes on carrying the allowed ones.
        with pytest.raises(PermissionDenied):
            producer.send("audit", b"nope again")
        producer.send("orders", b"four")

    with Client(server.endpoint, token=accounts.tokens["worker"]) as worker:
        with pytest.raises(PermissionDenied):
            worker.send_messages("orders", [Message(b"worker may not send")])
        received = worker.receive_messages("orders", max_messages=10, wait_time_ms=1000)
        assert received
        assert {message.body for message in received} <= {b"one", b"two", b"three", b"four"}
        assert all(result.ok for result in worker.delete_messages("orders", [m.receipt for m in received]))
        with pytest.raises(PermissionDenied):
            worker.receive_messages("audit", max_messages=1)

    with Client(server.endpoint, token=accounts.tokens["stranger"]) as stranger:
        for attempt in (
            lambda: stranger.send_messages("orders", [Message(b"stranger")]),
            lambda: stranger.receive_messages("orders", max_messages=1),
            lambda: stranger.attributes("orders"),
            lambda: stranger.describe("orders"),
            stranger.list_queues,
        ):
            with pytest.raises(PermissionDenied):
                attempt()

    with Client(server.endpoint, token=accounts.tokens["admin"]) as admin:
        assert sorted(admin.list_queues()) == sorted(QUEUES)
        assert admin.attributes("audit").visible == 0
    assert server.alive()
    remaining = stored(server, accounts, "orders")
    assert len(remaining) == 4 - len(received)
    assert stored(server, accounts, "audit") == []


def test_consumer_streams_and_exports_are_authorised_too(server: ServerProcess, accounts: Accounts) -> None:
    with Client(server.endpoint, token=accounts.tokens["producer"]) as producer:
        producer.send_messages("orders", [Message(f"m{i}".encode()) for i in range(5)])

    async def consume(token: str) -> list[bytes]:
        async with AsyncClient(server.endpoint, token=token) as consumer:
            got: list[bytes] = []
            async with consumer.consume("orders", credits=10) as stream:
                async for message in stream.messages():
                    got.append(message.body)
                    assert all(result.ok for result in await stream.delete([message.receipt]))
                    if len(got) == 5:
                        break
            return sorted(got)

    async def consume_within_a_minute(token: str) -> list[bytes]:
        return await asyncio.wait_for(consume(token), timeout=60)

    with pytest.raises(PermissionDenied):
        asyncio.run(consume_within_a_minute(accounts.tokens["stranger"]))
    assert asyncio.run(consume_within_a_minute(accounts.tokens["worker"])) == [f"m{i}".encode() for i in range(5)]

    channel = grpc.insecure_channel(server.endpoint)
    exports = export_pb2_grpc.ExportServiceStub(channel)
    bounds = export_pb2.GetJournalBoundsRequest(queue="orders", shard=0)
    for account in ("worker", "producer"):
        error = refused(
            lambda account=account: exports.GetJournalBounds(
                bounds, metadata=(("authorization", f"Bearer {accounts.tokens[account]}"),), timeout=10
            )
        )
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
        assert error_info_reason(error) == Reason.PERMISSION_DENIED.value
    analyst = with_token(exports, BearerToken(token=accounts.tokens["analyst"]))
    assert analyst.GetJournalBounds(bounds, timeout=10).shards == 2
    journal = list(analyst.ReadJournal(export_pb2.ReadJournalRequest(queue="orders", shard=0), timeout=10))
    assert journal  # every send to shard 0 and every delete, for the analyst to count
    channel.close()


def test_a_right_granted_while_the_server_runs_is_taken_within_seconds(
    server: ServerProcess, accounts: Accounts, api_client: client.ApiClient, namespace: str
) -> None:
    with Client(server.endpoint, token=accounts.tokens["stranger"]) as stranger:
        with pytest.raises(PermissionDenied):
            stranger.send_messages("audit", [Message(b"too early")])
        grant(api_client, namespace, "stranger", queue="audit", verbs=["send"])
        started = time.monotonic()

        def sent() -> bool | None:
            try:
                stranger.send_messages("audit", [Message(b"granted")])
            except PermissionDenied:
                return None
            return True

        # A refusal is remembered for ten seconds (runtime.client_access).
        wait_for(sent, timeout=30, interval=0.5, what="the new right to be taken")
        assert time.monotonic() - started < 30
    assert stored(server, accounts, "audit") == [b"granted"]


def test_clients_read_their_token_from_the_file_shardq_token_file_names(
    server: ServerProcess, accounts: Accounts, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(accounts.tokens["producer"] + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    with Client(server.endpoint) as producer:
        producer.send_messages("orders", [Message(b"from the file")])
    # The file's token is what the calls carry: the stranger's is known, and refused.
    token_file.write_text(accounts.tokens["stranger"])
    with Client(server.endpoint) as stranger, pytest.raises(PermissionDenied, match="stranger may not"):
        stranger.send_messages("orders", [Message(b"not from the stranger")])
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(Exception, match="SHARDQ_TOKEN_FILE: cannot read the token file"):
        Client(server.endpoint)
    assert stored(server, accounts, "orders") == [b"from the file"]


def test_the_cli_sends_the_token_its_token_file_option_names(
    server: ServerProcess, accounts: Accounts, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    for account in ("producer", "stranger"):
        (tmp_path / account).write_text(accounts.tokens[account])

    def send(*token_file: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "shardq", "send", "--endpoint", server.endpoint, "--queue", "orders"]
        return subprocess.run(
            [*command, "--body", "from the cli", *token_file], capture_output=True, text=True, timeout=60, check=False
        )

    sent = send("--token-file", str(tmp_path / "producer"))
    assert sent.returncode == 0, sent.stderr
    refused = send("--token-file", str(tmp_path / "stranger"))
    assert refused.returncode != 0
    assert "PERMISSION_DENIED" in refused.stderr
    assert "stranger may not" in refused.stderr
    anonymous = send()
    assert anonymous.returncode != 0
    assert "UNAUTHENTICATED" in anonymous.stderr
    assert "Traceback" not in refused.stderr + anonymous.stderr
    assert stored(server, accounts, "orders") == [b"from the cli"]


def test_an_api_server_that_cannot_answer_makes_calls_unavailable_not_admitted(
    tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str, accounts: Accounts
) -> None:
    # The same credentials, pointed at a port nothing listens on.
    unreachable = tmp_path / "unreachable.kubeconfig"
    config = json.loads(kubeconfig.read_text())  # e2e.kubecluster writes JSON
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{free_port()}"
    unreachable.write_text(json.dumps(config))
    process = authenticating_server(tmp_path, ["orders"], kubeconfig=unreachable, namespace=namespace)
    process.start()
    try:
        with Client(process.endpoint, token=accounts.tokens["admin"]) as admin:
            with pytest.raises(Unavailable) as unavailable:
                admin.send_messages("orders", [Message(b"x")])
            assert "cannot check the caller's token now" in unavailable.value.message
        assert process.alive()
    finally:
        process.cleanup()


def test_a_server_whose_account_may_not_ask_says_so_at_start_and_to_each_client(
    tmp_path: pathlib.Path,
    kubeconfig: pathlib.Path,
    namespace: str,
    accounts: Accounts,
    api_client: client.ApiClient,
) -> None:
    # The server runs as a ServiceAccount never bound to system:auth-delegator.
    client.CoreV1Api(api_client).create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="unbound-server"))
    )
    config = json.loads(kubeconfig.read_text())
    for entry in config["users"]:
        entry["user"] = {"token": account_token(api_client, namespace, "unbound-server", audiences=None)}
    as_unbound = tmp_path / "unbound.kubeconfig"
    as_unbound.write_text(json.dumps(config))
    process = authenticating_server(tmp_path, ["orders"], kubeconfig=as_unbound, namespace=namespace)
    process.start()
    try:
        assert "clients will be refused until this is fixed: create tokenreviews.authentication.k8s.io" in process.log()
        with Client(process.endpoint, token=accounts.tokens["admin"]) as admin:
            with pytest.raises(Unavailable) as unavailable:
                admin.send_messages("orders", [Message(b"x")])
            assert "403" in unavailable.value.message
            assert "bind it to the ClusterRole system:auth-delegator" in unavailable.value.message
        assert process.alive()
    finally:
        process.cleanup()


def test_in_a_cluster_forwarded_calls_pass_on_the_peer_secret_and_clients_still_need_rights(
    tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str, accounts: Accounts
) -> None:
    secret_file = tmp_path / "peer-secret"
    write_peer_secret(secret_file, new_peer_secret())
    common = ("--peer-secret-file", str(secret_file), "--client-auth", "kubernetes")
    cluster = Cluster(
        tmp_path / "cluster",
        placement=[["s1", "s2"], ["s2", "s1"]],
        spare_servers=("s3",),
        server_args=(*common, "--kubeconfig", str(kubeconfig), "--namespace", namespace),
    )
    admin_stub = with_token(
        queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(cluster.endpoint("s3"))),
        BearerToken(token=accounts.tokens["admin"]),
    )
    try:
        for server in cluster.servers:
            cluster.start(server)
        wait_for(lambda: every_shard_led(admin_stub, shards=2) or None, timeout=60, what="every shard led")
        # s3 leads nothing: every call to it is forwarded to s1 or s2, which take it on the
        # peer secret, having no token of the client's to review.
        with Client(cluster.endpoint("s3"), route_directly=False, token=accounts.tokens["producer"]) as producer:
            for i in range(8):
                assert not producer.send_messages("orders", [Message(f"f{i}".encode())])[0].error_reason
            with pytest.raises(PermissionDenied):
                producer.receive_messages("orders", max_messages=1)
        stranger = Client(cluster.endpoint("s3"), route_directly=False, token=accounts.tokens["stranger"])
        with stranger, pytest.raises(PermissionDenied):
            stranger.send_messages("orders", [Message(b"stranger")])
        with Client(cluster.endpoint("s3"), route_directly=False) as anonymous, pytest.raises(Unauthenticated):
            anonymous.send_messages("orders", [Message(b"anonymous")])
        # Routed straight to the leaders, each of which reviews the token itself.
        with Client(cluster.endpoint("s1"), token=accounts.tokens["worker"]) as worker:
            bodies = sorted(message.body for message in drain(worker, "orders"))
        assert bodies == sorted(f"f{i}".encode() for i in range(8))
    finally:
        cluster.stop_all()


def test_a_cluster_server_with_client_auth_and_no_peer_secret_refuses_to_start(
    tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str
) -> None:
    cluster = Cluster(
        tmp_path / "cluster",
        placement=[["s1"]],
        server_args=("--client-auth", "kubernetes", "--kubeconfig", str(kubeconfig), "--namespace", namespace),
    )
    try:
        cluster.start("s1")
        assert cluster.processes["s1"].wait(timeout=60) != 0
        assert "--client-auth in a cluster needs --peer-secret-file" in cluster.log("s1")
    finally:
        cluster.stop_all()


def test_a_redrive_back_to_the_source_queues_needs_admin_on_each_of_them(
    tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str, api_client: client.ApiClient
) -> None:
    """Without a destination a redrive moves messages to every queue that sends its dead
    letters to the DLQ: the caller needs the right to each, as it would naming them."""
    queues = [
        "orders-dlq",
        "orders:dead_letter_queue=orders-dlq,max_receive_count=1",
        "payments:dead_letter_queue=orders-dlq,max_receive_count=1",
    ]
    process = authenticating_server(tmp_path, queues, kubeconfig=kubeconfig, namespace=namespace)
    core = client.CoreV1Api(api_client)
    for account in ("partial", "whole"):
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=account))
        )
    for queue in ("orders-dlq", "payments"):
        grant(api_client, namespace, "partial", queue=queue, verbs=["admin"])
    grant(api_client, namespace, "whole", queue=None, verbs=EVERY_VERB)
    partial, whole = (account_token(api_client, namespace, a, audiences=[AUDIENCE]) for a in ("partial", "whole"))
    process.start()
    try:
        with Client(process.endpoint, token=whole) as admin:
            admin.send_messages("payments", [Message(b"payment")])
            deadline = time.monotonic() + 30
            while admin.attributes("orders-dlq").visible < 1:
                assert time.monotonic() < deadline, "the payment was not dead-lettered"
                admin.receive_messages("payments", max_messages=10, visibility_timeout_ms=0)
                time.sleep(0.05)
        with Client(process.endpoint, token=partial) as operator:
            with pytest.raises(PermissionDenied) as denied:
                list(operator.redrive(source="orders-dlq"))
            assert "may not admin on queue 'orders'" in denied.value.message
            # Named, the queue it may administer is enough.
            assert list(operator.redrive(source="orders-dlq", destination="payments"))[-1].moved == 1
        with Client(process.endpoint, token=whole) as admin:
            assert [m.body for m in drain(admin, "payments")] == [b"payment"]
            admin.send_messages("payments", [Message(b"again")])
            while admin.attributes("orders-dlq").visible < 1:
                assert time.monotonic() < deadline + 30, "the second payment was not dead-lettered"
                admin.receive_messages("payments", max_messages=10, visibility_timeout_ms=0)
                time.sleep(0.05)
            last = list(admin.redrive(source="orders-dlq"))[-1]
            assert (last.done, last.moved, last.kept) == (True, 1, 0)
            assert [m.body for m in drain(admin, "payments")] == [b"again"]
    finally:
        process.cleanup()
