"""The Spark source's reads ride out a server restart (a rolling update, a crashed pod):
a read made while the server is down waits for it, a journal stream that breaks resumes
after its last batch without repeating or skipping an event, and a snapshot that breaks
midway fails rather than passing off part of a shard as all of it. Errors that will not
pass (an unknown queue) and a server that stays down end the read with a clear error.

Before, every one of these reads failed at the first refused connection, and a batch
report run during a rolling update failed its planning on the driver."""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Iterator

import pytest

from shardq import Client, Message
from shardq.errors import QueueNotFound, Reason, ShardqError
from shardq.spark.exporting import ExportConnection
from tests.support.servers import ServerProcess

# Enough journal that a stream cannot sit whole in the client's flow-control window
# when the server dies: the break then falls in the middle of the stream.
MESSAGES = 30_000
BATCH = 1_000


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[ServerProcess]:
    process = ServerProcess.in_directory(tmp_path, ["orders:shards=1"])
    process.start()
    try:
        with Client(process.endpoint) as client:
            for start in range(0, MESSAGES, BATCH):
                results = client.send_messages(
                    "orders", [Message(f"m{n:05}".encode() * 20) for n in range(start, start + BATCH)]
                )
                assert all(result.ok for result in results)
        yield process
    finally:
        process.cleanup()


def restart_after(server: ServerProcess, seconds: float) -> threading.Thread:
    def restart() -> None:
        time.sleep(seconds)
        server.start()

    thread = threading.Thread(target=restart)
    thread.start()
    return thread


def journal_indexes(connection: ExportConnection, *, to_index: int) -> list[int]:
    indexes: list[int] = []
    for batch in connection.journal_batches(queue="orders", shard=0, from_index=1, to_index=to_index, batch_size=100):
        indexes.extend(event.log_index for event in batch.events)
    return indexes


@pytest.mark.timeout(120)
def test_reads_made_while_the_server_is_down_wait_for_it(server: ServerProcess) -> None:
    with ExportConnection(server.endpoint, rpc_timeout_seconds=5) as connection:
        before = connection.journal_bounds("orders", 0)
        stored = {
            message.message_id
            for batch in connection.message_batches(queue="orders", shard=0, include_body=False, batch_size=1000)
            for message in batch.messages
        }
    assert len(stored) == MESSAGES

    server.kill()
    restarting = restart_after(server, 1.5)
    try:
        with ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=60) as connection:
            assert connection.all_journal_bounds("orders") == {0: before}
        server.kill()
        restarting.join()
        restarting = restart_after(server, 1.5)
        with ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=60) as connection:
            exported = [
                message.message_id
                for batch in connection.message_batches(queue="orders", shard=0, include_body=False, batch_size=1000)
                for message in batch.messages
            ]
    finally:
        restarting.join()
    assert len(exported) == len(set(exported)) == MESSAGES
    assert set(exported) == stored


@pytest.mark.timeout(120)
def test_a_journal_stream_that_breaks_resumes_after_its_last_batch(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    with ExportConnection(server.endpoint, rpc_timeout_seconds=5) as connection:
        end = connection.journal_bounds("orders", 0).last_index + 1
        whole = journal_indexes(connection, to_index=end)
    assert len(whole) == MESSAGES

    caplog.set_level(logging.WARNING, logger="shardq.spark.exporting")
    read: list[int] = []
    restarting: threading.Thread | None = None
    try:
        with ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=60) as connection:
            batches = connection.journal_batches(queue="orders", shard=0, from_index=1, to_index=end, batch_size=100)
            for batch in batches:
                read.extend(event.log_index for event in batch.events)
                if restarting is None:
                    server.kill()  # after the first batch: the rest of the stream breaks
                    restarting = restart_after(server, 1.0)
    finally:
        if restarting is not None:
            restarting.join()  # before the fixture stops the server it restarts
    assert restarting is not None

    assert read == whole, "the resumed stream repeated or skipped events"
    broke = [record.getMessage() for record in caplog.records if "ReadJournal" in record.getMessage()]
    assert broke, "the stream never broke: the test did not exercise a resume"
    assert "trying again" in broke[0]


@pytest.mark.timeout(120)
def test_a_snapshot_that_breaks_midway_fails_instead_of_returning_part_of_the_shard(server: ServerProcess) -> None:
    exported = 0

    def read_the_snapshot(connection: ExportConnection) -> None:
        nonlocal exported
        for batch in connection.message_batches(queue="orders", shard=0, include_body=True, batch_size=100):
            exported += len(batch.messages)
            if server.alive():
                server.kill()  # after the first batch

    with (
        ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=60) as connection,
        pytest.raises(ShardqError) as failed,
    ):
        read_the_snapshot(connection)
    assert failed.value.reason is Reason.UNAVAILABLE, failed.value
    assert 0 < exported < MESSAGES


@pytest.mark.timeout(120)
def test_lasting_failures_end_the_read_with_an_error_that_says_so(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="shardq.spark.exporting")
    with (
        ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=60) as connection,
        pytest.raises(QueueNotFound),
    ):
        connection.journal_bounds("no-such-queue", 0)
    assert not caplog.records, "an unknown queue was retried"

    server.stop()
    with ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=1.0) as connection:
        started = time.monotonic()
        with pytest.raises(ShardqError) as failed:
            connection.journal_bounds("orders", 0)
        waited = time.monotonic() - started
    assert failed.value.reason is Reason.UNAVAILABLE
    assert "after 1 s of retries (option retrySeconds)" in str(failed.value)
    assert waited >= 1.0, "gave up before its retry budget was spent"

    with (
        ExportConnection(server.endpoint, rpc_timeout_seconds=5, retry_seconds=0) as connection,
        pytest.raises(ShardqError) as failed,
    ):
        connection.journal_bounds("orders", 0)
    assert failed.value.reason is Reason.UNAVAILABLE
    assert "retrySeconds" not in str(failed.value)
