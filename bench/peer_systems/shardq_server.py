"""shardq itself, behind the same interface as its peers: one `shardq serve` (fsync on, the
default) with a queue of four shards, as `bench/dataplane.py` and `bench/latency.py` run
it, and one AsyncClient per process shared by every caller, as the client is meant to be
used (concurrent calls of one client share requests).

send is `send_messages` (a unary call), receive `receive_messages` with no wait and a 30 s
visibility timeout, delete `delete_messages` of one receipt: SQS's calls, one at a time.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import dataplane  # bench/dataplane.py: the bench directory is on sys.path

from peer_systems import VISIBILITY_TIMEOUT_S, PeerQueue, Running
from shardq.aio import AsyncClient
from shardq.types import Message

NAME = "shardq"
SHARDS = 4


class ShardqQueue:
    """One caller's view of the process's shared client: the last one closed closes it."""

    def __init__(self, client: AsyncClient, queue: str, views: list[ShardqQueue]) -> None:
        self._client = client
        self._queue = queue
        self._views = views
        views.append(self)

    async def send(self, bodies: Sequence[bytes]) -> None:
        results = await self._client.send_messages(self._queue, [Message(body) for body in bodies])
        failed = [result for result in results if not result.ok]
        if failed:
            raise RuntimeError(f"sends failed: {failed[:3]}")

    async def receive(self, max_messages: int) -> list[Any]:
        messages = await self._client.receive_messages(
            self._queue, max_messages=max_messages, visibility_timeout_ms=VISIBILITY_TIMEOUT_S * 1000, wait_time_ms=0
        )
        return [message.receipt for message in messages]

    async def delete(self, handle: Any) -> None:
        await self._client.delete_messages(self._queue, [handle])

    async def close(self) -> None:
        self._views.remove(self)
        if not self._views:
            await self._client.close()


@contextlib.contextmanager
def running(workdir: pathlib.Path, queue: str) -> Iterator[Running]:
    server = dataplane.start_server(workdir / "data", f"{queue}:shards={SHARDS}", None)
    views: list[ShardqQueue] = []

    async def connect() -> PeerQueue:
        client = views[0]._client if views else await dataplane.connect(server.endpoint)
        return ShardqQueue(client, queue, views)

    try:
        yield Running(
            name=NAME,
            version=f"shardq {dataplane.git_revision()}",
            durability=f"LMDB, fsynced before every answer ({SHARDS} shards, one server)",
            pids=[server.process.pid],
            connect=connect,
            notes="one client per process shared by all callers (concurrent calls share requests)",
        )
    finally:
        dataplane.stop_process(server.process)
