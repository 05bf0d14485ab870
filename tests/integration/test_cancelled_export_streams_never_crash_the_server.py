"""Export and journal streams cancelled at any point, many times, under load, never crash the server.

A journal read cancelled after one batch used to free its LMDB read transaction on
the event loop while a worker thread was still walking its cursor: the second
cancellation killed the server with a segmentation fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc

from shardq import AsyncClient, Client, Message
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.errors import ShardqError
from tests.support.servers import ServerProcess, stored_count

QUEUE = "orders"
SHARDS = 4
PRELOADED = 2_000
ROUNDS = 6
CANCEL_POINTS = (0, 1, 2, 5)
# Large batches keep a worker thread busy on the cursor when the cancellation arrives.
BATCH_SIZES = (400, 1, 2_000, 50)
LOAD_DEADLINE_S = 60.0


def open_stream(stub: export_pb2_grpc.ExportServiceStub, kind: str, shard: int, batch_size: int) -> object:
    if kind == "journal":
        return stub.ReadJournal(export_pb2.ReadJournalRequest(queue=QUEUE, shard=shard, batch_size=batch_size))
    return stub.ExportMessages(
        export_pb2.ExportMessagesRequest(queue=QUEUE, shard=shard, batch_size=batch_size, include_body=True)
    )


async def read_then_cancel(endpoint: str, kind: str, shard: int, batches: int, *, close_channel: bool) -> int:
    """Read `batches` batches, then give up: by cancelling the call or by dropping the channel."""
    channel = grpc.aio.insecure_channel(endpoint)
    stub = export_pb2_grpc.ExportServiceStub(channel)
    call = open_stream(stub, kind, shard, batch_size=BATCH_SIZES[batches % len(BATCH_SIZES)])
    read = 0
    try:
        async for _ in call:  # type: ignore[attr-defined]
            if read >= batches:
                break
            read += 1
    finally:
        if close_channel:
            await channel.close(grace=None)
        else:
            call.cancel()  # type: ignore[attr-defined]
            await channel.close()
    return read


async def load(endpoint: str, stop: asyncio.Event) -> tuple[int, int]:
    """Sends and deletes going on while streams are abandoned; returns (sent, deleted)."""
    sent = deleted = 0
    deadline = time.monotonic() + LOAD_DEADLINE_S
    async with AsyncClient(endpoint) as client:
        while not stop.is_set() and time.monotonic() < deadline and sent < 20_000:
            results = await client.send_messages(QUEUE, [Message(b"load %d" % (sent + i)) for i in range(10)])
            sent += len(results)
            received = await client.receive_messages(QUEUE, max_messages=5, visibility_timeout_ms=60_000)
            if received:
                outcomes = await client.delete_messages(QUEUE, [message.receipt for message in received])
                assert all(outcome.ok for outcome in outcomes), outcomes
                deleted += len(outcomes)
    return sent, deleted


async def abandon_streams_under_load(endpoint: str) -> tuple[int, int, int]:
    stop = asyncio.Event()
    loader = asyncio.create_task(load(endpoint, stop))
    abandoned = 0
    try:
        for round_number in range(ROUNDS):
            for kind in ("journal", "export"):
                for batches in CANCEL_POINTS:
                    shard = (round_number + batches) % SHARDS
                    close_channel = (round_number + batches) % 2 == 1
                    await read_then_cancel(endpoint, kind, shard, batches, close_channel=close_channel)
                    abandoned += 1
            # Many abandoned at once, racing each other on the same shard.
            await asyncio.gather(
                *(
                    read_then_cancel(endpoint, kind, round_number % SHARDS, 1, close_channel=False)
                    for kind in ("journal", "export")
                    for _ in range(4)
                )
            )
            abandoned += 8
    finally:
        stop.set()
        sent, deleted = await loader
    return abandoned, sent, deleted


def exit_status(server: ServerProcess) -> str:
    assert server.process is not None
    code = server.process.poll()
    return f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"


def test_abandoned_export_and_journal_streams_leave_the_server_serving(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        for start in range(0, PRELOADED, 500):
            client.send_messages(QUEUE, [Message(b"x" * 200 + b"%d" % i) for i in range(start, start + 500)])

    try:
        abandoned, sent, deleted = asyncio.run(abandon_streams_under_load(server.endpoint))
    except (grpc.RpcError, ShardqError):
        assert server.alive(), f"server died with {exit_status(server)} while streams were abandoned"
        raise

    assert abandoned == ROUNDS * (2 * len(CANCEL_POINTS) + 8)
    assert server.alive(), f"server died with {exit_status(server)}:\n{server.log()[-3000:]}"
    assert "Fatal Python error" not in server.log()
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == PRELOADED + sent - deleted


def test_a_full_journal_read_after_abandoned_ones_returns_every_entry(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        for start in range(0, 400, 100):
            client.send_messages(QUEUE, [Message(b"m%d" % i) for i in range(start, start + 100)])

    async def scenario() -> int:
        for batches in CANCEL_POINTS:
            await read_then_cancel(server.endpoint, "journal", 0, batches, close_channel=False)
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            stub = export_pb2_grpc.ExportServiceStub(channel)
            bounds = await stub.GetJournalBounds(export_pb2.GetJournalBoundsRequest(queue=QUEUE, shard=0))
            indexes: list[int] = []
            async for batch in stub.ReadJournal(export_pb2.ReadJournalRequest(queue=QUEUE, shard=0, batch_size=3)):
                indexes.extend(sorted({event.log_index for event in batch.events}))
            assert indexes == list(range(bounds.first_index, bounds.last_index + 1))
            return len(indexes)

    assert asyncio.run(scenario()) > 0
    assert server.alive()


def test_abandoned_streams_do_not_block_a_graceful_shutdown(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"y%d" % i) for i in range(200)])

    async def leave_streams_open() -> list[grpc.aio.Channel]:
        channels = []
        for kind in ("journal", "export"):
            channel = grpc.aio.insecure_channel(server.endpoint)
            call = open_stream(export_pb2_grpc.ExportServiceStub(channel), kind, 0, batch_size=1)
            await call.read()  # type: ignore[attr-defined]
            channels.append(channel)
        return channels

    loop = asyncio.new_event_loop()
    try:
        channels = loop.run_until_complete(leave_streams_open())
        assert server.stop() == 0, server.log()[-3000:]
        assert "Fatal Python error" not in server.log()
        for channel in channels:
            with contextlib.suppress(Exception):
                loop.run_until_complete(channel.close())
    finally:
        loop.close()
    server.start()
    with Client(server.endpoint) as client:
        assert stored_count(client, QUEUE) == 200
