"""Queues created, changed and deleted while a server runs, as with SQS and the
RabbitMQ and NATS CLIs: persisted across restarts, refused where the queues are
defined elsewhere, and `peek` looks without claiming."""

from __future__ import annotations

import json
import pathlib
import subprocess

import grpc
import pytest

from shardq import Client, Message
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.errors import InvalidArgument, QueueExists, QueueInUse, QueueManagedElsewhere, QueueNotFound
from shardq.status import error_from_rpc
from tests.support.cli import run_shardq
from tests.support.servers import ServerFactory, ServerProcess, stored_count


def test_a_created_queue_survives_a_restart_with_its_messages_and_settings(server_factory: ServerFactory) -> None:
    server = server_factory("static")
    with Client(server.endpoint) as client:
        settings = client.create_queue("jobs", {"shards": "2", "visibilityTimeout": "45s", "maxDepth": "100"})
        assert settings["shards"] == 2
        assert settings["visibility_timeout_ms"] == 45_000
        client.send_messages("jobs", [Message(b"job %d" % n) for n in range(7)])
    server.kill()  # no goodbye: the catalog must already be on disk
    server.start()
    with Client(server.endpoint) as client:
        assert sorted(client.list_queues()) == ["jobs", "static"]
        assert client.queue_settings("jobs")["max_depth"] == 100
        assert stored_count(client, "jobs") == 7


def test_creating_again_is_a_no_op_unless_the_settings_differ(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.create_queue("again", {"shards": "2"})
        client.send_messages("again", [Message(b"kept")])
        assert client.create_queue("again", {"shards": "2"})["shards"] == 2
        assert stored_count(client, "again") == 1
        with pytest.raises(QueueExists) as refused:
            client.create_queue("again", {"shards": "3"})
    assert "'again' already exists" in str(refused.value)
    with grpc.insecure_channel(server.endpoint) as channel, pytest.raises(grpc.RpcError) as raw:
        queue_pb2_grpc.QueueServiceStub(channel).CreateQueue(
            queue_pb2.CreateQueueRequest(queue="again", settings={"shards": "3"}), timeout=5
        )
    assert raw.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_bad_names_and_settings_are_invalid_arguments(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        with pytest.raises(InvalidArgument, match="not a queue name"):
            client.create_queue("Bad_Name")
        with pytest.raises(InvalidArgument, match="colour: unknown queue setting; valid"):
            client.create_queue("fine", {"colour": "blue"})
        # Once an OverflowError: UNKNOWN, with no reason and no field.
        with pytest.raises(InvalidArgument, match=r"visibility.*too long") as raised:
            client.create_queue("fine", {"visibility": "9" * 100_000})
        assert len(raised.value.message) < 400, "the error repeated the whole 100,000-character value"
        client.create_queue("fine-later", {"shards": "1"})
        with pytest.raises(InvalidArgument, match=r"retention.*too long"):
            client.set_queue_attributes("fine-later", {"retention": "9" * 400 + "d"})
        assert "fine" not in client.list_queues()


def test_a_deleted_queue_is_gone_with_its_data_also_after_a_restart(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.create_queue("temporary")
        client.send_messages("temporary", [Message(b"x"), Message(b"y")])
        assert client.delete_queue("temporary") == 2
        with pytest.raises(QueueNotFound):
            client.send_messages("temporary", [Message(b"z")])
    assert not (server.data_dir / "queues" / "temporary").exists()
    server.restart()
    with Client(server.endpoint) as client:
        assert "temporary" not in client.list_queues()
        client.create_queue("temporary")  # a new, empty queue of the same name
        assert stored_count(client, "temporary") == 0


def test_settings_one_server_would_not_honour_are_refused(server: ServerProcess) -> None:
    """A dead-letter queue that does not exist held every dead letter as pending for
    good; replicas on a standalone server were listed and never made."""
    with Client(server.endpoint) as client:
        with pytest.raises(InvalidArgument, match="deadLetterQueue: queue 'nope' does not exist: create it first"):
            client.create_queue("jobs", {"dlq": "nope", "maxReceiveCount": "3"})
        with pytest.raises(InvalidArgument, match="replicas: 3 copies need a cluster"):
            client.create_queue("jobs", {"replicas": "3"})
        assert "jobs" not in client.list_queues()
        client.create_queue("jobs")
        with pytest.raises(InvalidArgument, match="queue 'nope' does not exist"):
            client.set_queue_attributes("jobs", {"dlq": "nope", "maxReceiveCount": "3"})
        assert client.queue_settings("jobs")["dead_letter_queue"] == ""
        client.create_queue("jobs-dlq")
        client.set_queue_attributes("jobs", {"dlq": "jobs-dlq", "maxReceiveCount": "3"})
        assert client.queue_settings("jobs")["dead_letter_queue"] == "jobs-dlq"


def test_a_setting_changes_whichever_spelling_created_it(server: ServerProcess) -> None:
    """The saved settings and the change were merged key by key: `visibilityTimeout`
    beside the `visibility` the queue was created with left two keys for one setting."""
    with Client(server.endpoint) as client:
        client.create_queue("spelled", {"visibility": "10s"})
        assert client.set_queue_attributes("spelled", {"visibilityTimeout": "20s"})["visibility_timeout_ms"] == 20_000
        assert client.set_queue_attributes("spelled", {"visibility_timeout": "7s"})["visibility_timeout_ms"] == 7_000
        # Zero is a setting too: it was left out, and read as the default.
        assert client.set_queue_attributes("spelled", {"dedupWindow": "0s"})["dedup_window_ms"] == 0
        with pytest.raises(InvalidArgument, match="visibility and visibilityTimeout set the same setting"):
            client.create_queue("doubly", {"visibilityTimeout": "20s", "visibility": "10s"})
    server.restart()
    with Client(server.endpoint) as client:
        assert client.queue_settings("spelled")["visibility_timeout_ms"] == 7_000


def test_a_receipt_of_a_deleted_queue_does_not_act_on_the_queue_created_in_its_place(server: ServerProcess) -> None:
    """The new queue numbers its messages from 1 again: a receipt names its claim by
    shard, number, epoch and claim token, and the old queue's first claim once matched
    the new queue's, so a late acknowledgement deleted another consumer's message."""
    with Client(server.endpoint) as client:
        client.create_queue("reborn", {"shards": "1"})
        client.send_messages("reborn", [Message(b"old")])
        (old,) = client.receive_messages("reborn", max_messages=1, visibility_timeout_ms=60_000)
        client.delete_queue("reborn")
        client.create_queue("reborn", {"shards": "1"})
        client.send_messages("reborn", [Message(b"new")])
        (new,) = client.receive_messages("reborn", max_messages=1, visibility_timeout_ms=60_000)
        assert new.message_id != old.message_id
        for results in (
            client.delete_messages("reborn", [old.receipt]),
            client.change_visibility("reborn", [(old.receipt, 0)]),
            client.release_messages("reborn", [old.receipt]),
        ):
            assert [(r.ok, r.reason) for r in results] == [(False, "STALE_RECEIPT")]
        assert client.attributes("reborn").in_flight == 1, "the old receipt changed the new claim"
        assert [r.ok for r in client.delete_messages("reborn", [new.receipt])] == [True]
        assert stored_count(client, "reborn") == 0


def test_delete_refuses_a_dead_letter_queue_in_use_and_a_static_queue(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.create_queue("parking")
        client.create_queue("work", {"deadLetterQueue": "parking", "maxReceiveCount": "3"})
        with pytest.raises(QueueInUse, match="'parking' is the dead-letter queue of work"):
            client.delete_queue("parking")
        with pytest.raises(QueueManagedElsewhere, match="--queue/--config"):
            client.delete_queue("orders")  # given on the server's command line
        assert "parking" in client.list_queues()


def test_set_attributes_changes_what_the_next_receive_does_and_refuses_fixed_settings(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.create_queue("tunable", {"shards": "1", "visibilityTimeout": "30s"})
        changed = client.set_queue_attributes("tunable", {"visibilityTimeout": "7m", "maxDepth": "5"})
        assert changed["visibility_timeout_ms"] == 7 * 60_000
        client.send_messages("tunable", [Message(b"m")])
        (message,) = client.receive_messages("tunable", max_messages=1)
        assert 6 * 60_000 < message.visible_until_ms - message.first_received_at_ms <= 7 * 60_000
        with pytest.raises(InvalidArgument, match="shards cannot change"):
            client.set_queue_attributes("tunable", {"shards": "4"})
    server.restart()
    with Client(server.endpoint) as client:
        assert client.queue_settings("tunable")["visibility_timeout_ms"] == 7 * 60_000


def test_a_server_whose_queues_are_defined_elsewhere_refuses_and_names_the_place(tmp_path: pathlib.Path) -> None:
    # Started with the flag from the first (a stop and start on the same ports could
    # race another process for a port freed in between).
    server = ServerProcess.in_directory(
        tmp_path, ("orders",), "--queues-managed-by", "the Queue resources of namespace shop"
    )
    server.start()
    try:
        refuse_every_change(server)
    finally:
        server.cleanup()


def refuse_every_change(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        for change in (
            lambda: client.create_queue("new"),
            lambda: client.delete_queue("orders"),
            lambda: client.set_queue_attributes("orders", {"maxDepth": "3"}),
        ):
            with pytest.raises(QueueManagedElsewhere) as refused:
                change()
            assert "the Queue resources of namespace shop" in str(refused.value)


def test_peek_looks_without_claiming(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.send_messages("orders-dlq", [Message(b"look %d" % n) for n in range(3)])
        for _ in range(2):
            peeked = client.peek_messages("orders-dlq", max_messages=10)
            assert sorted(m.body for m in peeked) == [b"look 0", b"look 1", b"look 2"]
            assert all(m.receipt == "" and m.receive_count == 0 for m in peeked)
        received = client.receive_messages("orders-dlq", max_messages=10, visibility_timeout_ms=60_000)
        assert len(received) == 3
        assert all(m.receive_count == 1 for m in received)
        assert client.peek_messages("orders-dlq", max_messages=10) == []  # claimed now: nothing receivable
    # A peek does not long-poll: a wait asked of it is refused, not ignored.
    with grpc.insecure_channel(server.endpoint) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ReceiveMessages(
                queue_pb2.ReceiveMessagesRequest(queue="orders-dlq", max_messages=1, peek=True, wait_time_ms=5_000),
                timeout=10,
            )
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_from_rpc(raised.value).field == "wait_time_ms"


def test_the_cli_manages_queues_and_shows_depth_and_settings(server: ServerProcess) -> None:
    def shardq(*args: str) -> subprocess.CompletedProcess[str]:
        return run_shardq(server.endpoint, *args)

    created = shardq("create-queue", "cli-made", "--set", "shards=2", "--set", "visibility=1m")
    assert created.returncode == 0, created.stderr
    assert "shards=2" in created.stdout
    assert "visibility_timeout=1m" in created.stdout
    assert shardq("send", "--queue", "cli-made", "--body", "hello").returncode == 0
    peeked = shardq("receive", "--queue", "cli-made", "--peek", "--json")
    assert json.loads(peeked.stdout)["body"] == "hello"
    listing = json.loads(next(line for line in shardq("queues", "--json").stdout.splitlines() if '"cli-made"' in line))
    assert listing["visible"] == 1
    assert listing["settings"]["shards"] == 2
    changed = shardq("set-attributes", "cli-made", "--set", "maxDepth=10")
    assert changed.returncode == 0, changed.stderr
    assert "max_depth=10" in changed.stdout
    deleted = shardq("delete-queue", "cli-made", "--yes")
    assert deleted.stdout.strip() == "deleted queue cli-made (1 message)"
    refused = shardq("delete-queue", "orders", "--yes")
    assert refused.returncode == 1
    assert "defined by the server's --queue/--config" in refused.stderr


def test_deleting_a_queue_ends_its_long_polls_with_queue_not_found(server: ServerProcess) -> None:
    import threading

    with Client(server.endpoint) as client:
        client.create_queue("polled")
        errors: list[BaseException] = []

        def long_poll() -> None:
            try:
                with Client(server.endpoint) as poller:
                    poller.receive_messages("polled", max_messages=1, wait_time_ms=20_000)
            except BaseException as error:
                errors.append(error)

        polling = threading.Thread(target=long_poll)
        polling.start()
        time_to_start = 1.0
        polling.join(timeout=time_to_start)
        client.delete_queue("polled")
        polling.join(timeout=30)
    (error,) = errors
    assert isinstance(error, QueueNotFound), repr(error)
    assert server.alive()
