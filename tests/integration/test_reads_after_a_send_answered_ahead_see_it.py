"""A standalone server answers a send once its entry is durable in the commit-ahead file,
before LMDB commits it. Whatever a caller does once answered sees the send, as it would
had LMDB committed it: a short-poll receive claims it, the queue's counts and a peek
show it, an export's snapshot holds it, and so does the journal, read up to the end its
bounds give; deleting the queue counts it among the messages deleted. A receive is
answered once its claims are decided, before its batch commits (not written ahead: it
has no answer to hasten), and the queue's counts made once it is answered count its
messages in flight.

Each read starts while LMDB's commit of the send is held by a fault injector
(tests/support/held_commits.py), in a real server run in this process, on the writer
thread (holding a commit made on the event loop would hold the loop itself); the
server, its gRPC calls, the store and the commit-ahead file are the real ones. (A peek
reads on the writer thread, after the held commit, so here it would see the send even
without waiting for the commit; the wait is for the event loop's path, where LMDB
commits a few loop turns after the answer, too soon for any client to read between.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
import pytest

from shard_server.runtime import queue_hosts
from shard_server.runtime.committing import WriterThreads
from shard_server.runtime.hosting import HostedQueue
from shard_server.server import ServerSettings, serve
from shard_server.storage.lmdb_store import ShardEnvironment
from shardq import AsyncClient, Message
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.queues import QueueConfig
from tests.support.held_commits import HeldCommitEnvironment
from tests.support.ports import LOOPBACK, free_port

QUEUE = "orders"
# Long enough for a read that would not wait for the commit to have answered already.
READ_STARTED_S = 0.3
T = TypeVar("T")


@pytest.fixture
def environments(monkeypatch: pytest.MonkeyPatch) -> list[HeldCommitEnvironment]:
    """Every shard environment the server opens, each one whose commits can be held."""
    opened: list[HeldCommitEnvironment] = []

    def open_held(queue: HostedQueue, index: int) -> ShardEnvironment:
        environment = HeldCommitEnvironment(
            queue.directory / f"shard-{index}",
            queue=queue.config.name,
            shard=index,
            map_size=queue.map_size,
            commit_ahead=True,
        )
        opened.append(environment)
        return environment

    monkeypatch.setattr(HostedQueue, "open_environment", open_held)
    monkeypatch.setattr(queue_hosts, "WriterThreads", functools.partial(WriterThreads, commit_on_loop_when_idle=False))
    return opened


@contextlib.asynccontextmanager
async def serving(settings: ServerSettings) -> AsyncIterator[AsyncClient]:
    """A real server run in this process, and a client once it answers."""
    stop = asyncio.Event()
    server = asyncio.create_task(serve(settings, stop=stop))
    try:
        async with AsyncClient(f"{settings.host}:{settings.port}") as client:
            for _ in range(100):
                try:
                    await client.list_queues()
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            yield client
    finally:
        stop.set()
        await asyncio.wait_for(server, 30)


async def sent_then_read(
    client: AsyncClient,
    environment: HeldCommitEnvironment,
    body: bytes,
    read: Callable[[], Awaitable[T]],
    *,
    queue: str = QUEUE,
) -> T:
    """Send `body`, and once it is answered and LMDB's commit of it held, start `read`;
    the commit is released only after the read had time to answer without it."""
    hold = environment.hold_next_commit(sending=body)
    await client.send_messages(queue, [Message(body)])
    assert await asyncio.to_thread(hold.reached.wait, 5), "the send was not written ahead"
    try:
        reading = asyncio.ensure_future(read())
        await asyncio.sleep(READ_STARTED_S)
    finally:
        hold.release()
    return await asyncio.wait_for(reading, 10)


async def exported_bodies(endpoint: str) -> list[bytes]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        batches = stub.ExportMessages(export_pb2.ExportMessagesRequest(queue=QUEUE, shard=0, include_body=True))
        return [message.body async for batch in batches for message in batch.messages]


async def journaled_sends(endpoint: str, *, up_to_the_bounds: bool) -> int:
    """How many sends the shard's journal holds, read up to the end its bounds give, or
    to its end (to_index 0)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = export_pb2_grpc.ExportServiceStub(channel)
        request = export_pb2.ReadJournalRequest(queue=QUEUE, shard=0, from_index=1)
        if up_to_the_bounds:
            bounds = await stub.GetJournalBounds(export_pb2.GetJournalBoundsRequest(queue=QUEUE, shard=0))
            request.from_index, request.to_index = bounds.first_index, bounds.last_index + 1
        events = [event async for batch in stub.ReadJournal(request) for event in batch.events]
    return sum(event.type == export_pb2.JOURNAL_EVENT_TYPE_SENT for event in events)


def test_reads_made_once_a_send_is_answered_see_it_before_lmdb_committed_it(
    tmp_path: pathlib.Path, environments: list[HeldCommitEnvironment]
) -> None:
    port = free_port()
    endpoint = f"{LOOPBACK}:{port}"
    settings = ServerSettings(data_dir=tmp_path, queues=[QueueConfig(name=QUEUE, shards=1)], host=LOOPBACK, port=port)

    async def scenario() -> None:
        async with serving(settings) as client:
            (environment,) = environments

            received = await sent_then_read(client, environment, b"received", lambda: client.receive_messages(QUEUE))
            assert [message.body for message in received] == [b"received"]

            counts = await sent_then_read(client, environment, b"counted", lambda: client.attributes(QUEUE))
            assert (counts.visible, counts.in_flight) == (1, 1)

            peeked = await sent_then_read(client, environment, b"peeked", lambda: client.peek_messages(QUEUE))
            assert [message.body for message in peeked] == [b"counted", b"peeked"]

            exported = await sent_then_read(client, environment, b"exported", lambda: exported_bodies(endpoint))
            assert sorted(exported) == sorted([b"received", b"counted", b"peeked", b"exported"])

            journaled = await sent_then_read(
                client, environment, b"journaled", lambda: journaled_sends(endpoint, up_to_the_bounds=True)
            )
            assert journaled == 5
            journaled = await sent_then_read(
                client,
                environment,
                b"journaled to the end",
                lambda: journaled_sends(endpoint, up_to_the_bounds=False),
            )
            assert journaled == 6

            await client.create_queue("created", {"shards": "1"})
            created = environments[-1]
            deleted = await sent_then_read(
                client, created, b"deleted", lambda: client.delete_queue("created"), queue="created"
            )
            assert deleted == 1

    asyncio.run(scenario())


def test_counts_made_once_a_receive_is_answered_see_its_claims_before_lmdb_committed_them(
    tmp_path: pathlib.Path, environments: list[HeldCommitEnvironment]
) -> None:
    queues = [QueueConfig(name=QUEUE, shards=1)]
    settings = ServerSettings(data_dir=tmp_path, queues=queues, host=LOOPBACK, port=free_port())

    async def scenario() -> None:
        async with serving(settings) as client:
            (environment,) = environments
            await client.send_messages(QUEUE, [Message(b"claimed"), Message(b"left")])
            hold = environment.hold_next_commit(written_ahead=False)
            received = await client.receive_messages(QUEUE, max_messages=1)
            assert [message.body for message in received] == [b"claimed"]
            assert await asyncio.to_thread(hold.reached.wait, 5), "the receive's commit was not held"
            try:
                counting = asyncio.ensure_future(client.attributes(QUEUE))
                await asyncio.sleep(READ_STARTED_S)
            finally:
                hold.release()
            counts = await asyncio.wait_for(counting, 10)
            assert (counts.visible, counts.in_flight) == (1, 1)

    asyncio.run(scenario())
