"""A shard environment closes only once no thread is inside it (real LMDB, real threads).

Closing frees every transaction and cursor; a worker still walking a cursor
would read freed memory. These pin the order: close waits for the running
batch, a held snapshot is let go between batches, and late users get a clear
UNAVAILABLE error instead of a crash.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator

import pytest

from shard_server.domain import sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.storage.closing_gate import EnvironmentClosed
from shard_server.storage.lmdb_store import HeldRead, LmdbShardTransaction, ShardEnvironment
from shardq.errors import Reason
from shardq.queues import QueueConfig

WAIT_S = 10.0


def filled_environment(path: pathlib.Path, messages: int = 50) -> ShardEnvironment:
    environment = ShardEnvironment(path, queue="orders", shard=0, map_size=1 << 26)

    context = ShardContext(QueueConfig(name="orders"), shard=0, epoch=1)

    def send_all(tx: LmdbShardTransaction) -> None:
        batch = [NewMessage(b"body %d" % n, {}, "", "", 0) for n in range(messages)]
        sending.send_messages(tx, context, batch, now_ms=1000)

    environment.write(send_all, epoch=1, at_ms=1000)
    return environment


def test_close_waits_for_a_reader_inside_a_transaction(tmp_path: pathlib.Path) -> None:
    environment = filled_environment(tmp_path / "shard")
    inside = threading.Event()
    may_finish = threading.Event()
    counted: list[int] = []

    def slow_reader() -> None:
        with environment.read() as tx:
            inside.set()
            assert may_finish.wait(WAIT_S)
            counted.append(sum(1 for _ in tx.iter_messages()))

    reader = threading.Thread(target=slow_reader)
    reader.start()
    assert inside.wait(WAIT_S)
    closer = threading.Thread(target=environment.close)
    closer.start()
    closer.join(timeout=0.3)
    assert closer.is_alive(), "the environment closed under a running reader"
    may_finish.set()
    reader.join(WAIT_S)
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert counted == [50]
    with pytest.raises(EnvironmentClosed) as refused, environment.read():
        pass
    assert refused.value.reason is Reason.UNAVAILABLE


def test_a_held_snapshot_is_let_go_after_its_running_batch(tmp_path: pathlib.Path) -> None:
    environment = filled_environment(tmp_path / "shard")
    held = environment.hold_read()
    rows = held.tx.iter_messages()
    inside = threading.Event()
    may_finish = threading.Event()
    batches: list[int] = []

    def batch(_tx: LmdbShardTransaction) -> int:
        inside.set()
        assert may_finish.wait(WAIT_S)
        return sum(1 for _, _ in zip(range(10), rows, strict=False))

    worker = threading.Thread(target=lambda: batches.append(held.run(batch)))
    worker.start()
    assert inside.wait(WAIT_S)
    held.release()  # the stream was cancelled while its batch runs: must not block or free
    closer = threading.Thread(target=environment.close)
    closer.start()
    closer.join(timeout=0.3)
    assert closer.is_alive(), "the environment closed under a running batch"
    may_finish.set()
    worker.join(WAIT_S)
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert batches == [10]
    with pytest.raises(EnvironmentClosed):
        held.run(batch)


def test_closing_lets_go_of_an_idle_held_snapshot(tmp_path: pathlib.Path) -> None:
    environment = filled_environment(tmp_path / "shard")
    held = environment.hold_read()
    assert held.run(lambda tx: tx.message_count()) == 50
    closer = threading.Thread(target=environment.close)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close waited forever for a stream that was between batches"
    with pytest.raises(EnvironmentClosed):
        held.run(lambda tx: tx.message_count())
    held.release()  # the stream's own cleanup afterwards is harmless


def test_a_reader_and_a_closer_racing_many_times_never_crash(tmp_path: pathlib.Path) -> None:
    for attempt in range(30):
        environment = filled_environment(tmp_path / f"shard{attempt}", messages=200)
        held = environment.hold_read()
        rows = held.tx.iter_messages()
        results: list[object] = []

        def read_all(held: HeldRead = held, rows: Iterator[object] = rows, results: list[object] = results) -> None:
            try:
                while held.run(lambda _tx: sum(1 for _, _ in zip(range(7), rows, strict=False))):
                    pass
                results.append("done")
            except EnvironmentClosed:
                results.append("closed")

        worker = threading.Thread(target=read_all)
        worker.start()
        environment.close()
        worker.join(WAIT_S)
        assert results in (["done"], ["closed"])
