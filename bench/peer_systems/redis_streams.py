"""Redis as a queue the way Redis users build a reliable one: a Stream with a consumer group.

What it runs: Debian's `redis-server` (7.0) as a child process on a free 127.0.0.1 port,
with no config file (so nothing from the package's /etc/redis applies) and only these
settings on its command line:

- `--appendonly yes --appendfsync always`: every write command is appended to the AOF
  and fsynced before the reply is sent, so an acknowledged XADD is on disk. This is the
  strictest durability Redis offers and the one comparable to a queue that fsyncs.
- `--save ""`: no RDB snapshots, so no fork()ed background save competes for the CPU and
  disk mid-run; the AOF alone is the durable copy.
- `--dir <workdir>`: the AOF (Redis 7 writes it as `appendonlydir/`) stays under workdir.
  A workdir used before is replayed from it, stream, group and messages included.

Why Streams with a consumer group, not a list (LPUSH/BRPOPLPUSH): it is what Redis
documents for at-least-once consumption. XREADGROUP hands each entry to one consumer and
keeps it in the group's pending entries list until XACK, which is the nearest Redis has to
SQS's receive/delete. The three operations:

- send: XADD per body; ten bodies go as one MULTI/EXEC pipeline, one round trip, all or
  none, like one SendMessageBatch.
- receive: XREADGROUP ... COUNT n STREAMS key > without BLOCK, so it answers at once
  with what is new (empty when nothing is); the handle is the entry id.
- delete: XACK (out of the pending list) and XDEL (out of the stream, so it does not grow
  without bound) in one MULTI/EXEC pipeline, awaited.

Each caller gets its own client with a one-connection pool (pipelines use the pool, so a
single-connection client would open a second one) and its own consumer name: one call in
flight per caller is one connection in use, as a pool would give.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import re
import subprocess
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.asyncio

from peer_systems import VISIBILITY_TIMEOUT_S, PeerQueue, Running, child_process, free_port, wait_for_port

NAME = "redis"

SERVER = "redis-server"
GROUP = "workers"
# Field name of the one field each entry holds: Streams store field/value pairs.
FIELD = b"body"
START_TIMEOUT_S = 30.0


class StreamQueue:
    """One caller's view: a client of its own (one connection) and a consumer name of its own."""

    def __init__(self, client: redis.asyncio.Redis, key: str, consumer: str) -> None:
        self._client = client
        self._key = key
        self._consumer = consumer

    async def send(self, bodies: Sequence[bytes]) -> None:
        if len(bodies) == 1:
            await self._client.xadd(self._key, {FIELD: bodies[0]})
            return
        # MULTI/EXEC: one round trip, and the batch is applied (and fsynced) as one.
        async with self._client.pipeline(transaction=True) as pipe:
            for body in bodies:
                pipe.xadd(self._key, {FIELD: body})
            await pipe.execute()

    async def receive(self, max_messages: int) -> list[Any]:
        # No BLOCK: answer now with whatever is new to the group, as the other systems do.
        # ">" means entries never delivered to any consumer of the group.
        reply = await self._client.xreadgroup(GROUP, self._consumer, {self._key: ">"}, count=max_messages)
        # RESP2 (pinned in connect) answers [[stream, [(entry_id, {field: value}), ...]]], or
        # [] when nothing is new; RESP3 would answer a dict.
        if not isinstance(reply, list):
            raise TypeError(f"XREADGROUP answered {type(reply).__name__}, expected a RESP2 list")
        return [entry_id for _stream, entries in reply for entry_id, _fields in entries]

    async def delete(self, handle: Any) -> None:
        # XACK alone would leave the entry in the stream forever; XDEL alone would leave it
        # in the pending list. Both, atomically, in one round trip.
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.xack(self._key, GROUP, handle)
            pipe.xdel(self._key, handle)
            await pipe.execute()

    async def close(self) -> None:
        await self._client.aclose()


def _version() -> str:
    # `redis-server --version` prints e.g. "Redis server v=7.0.15 sha=... malloc=...".
    output = subprocess.run([SERVER, "--version"], check=True, capture_output=True, text=True).stdout
    match = re.search(r"v=(\S+)", output)
    return f"Redis {match.group(1) if match else output.strip()}"


@contextlib.contextmanager
def running(workdir: pathlib.Path, queue: str) -> Iterator[Running]:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        SERVER,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--daemonize",
        "no",
        # Log to stdout, which child_process sends to the log file under workdir.
        "--logfile",
        "",
    ]
    # child_process stops the server by PID (SIGTERM: Redis flushes the AOF and exits)
    # whatever happens in the body.
    with child_process(command, log=str(workdir / "redis-server.log")) as server:
        wait_for_port(port, process=server, timeout_s=START_TIMEOUT_S, what=SERVER)
        key = queue
        with redis.Redis(host="127.0.0.1", port=port) as admin:
            # MKSTREAM creates the (empty) stream with the group; id 0 so the group sees any
            # entry already in it. A workdir used before still holds both in its AOF
            # (that is the durability): keep them rather than fail.
            try:
                admin.xgroup_create(key, GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if not str(error).startswith("BUSYGROUP"):
                    raise
        consumers = itertools.count(1)

        async def connect() -> PeerQueue:
            # max_connections=1: the caller's commands and pipelines share one connection.
            client = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=1, protocol=2)
            return StreamQueue(client, key, f"consumer-{next(consumers)}")

        yield Running(
            name=NAME,
            version=_version(),
            durability="appendonly yes, appendfsync always: every write is fsynced to the AOF before Redis replies",
            pids=[server.pid],
            connect=connect,
            notes=(
                "Streams have no visibility timeout: a received entry stays in the consumer "
                "group's pending list, invisible to other consumers, until it is XACKed or "
                "another consumer takes it over with XAUTOCLAIM (which this workload never "
                f"does), instead of reappearing after {VISIBILITY_TIMEOUT_S} s. "
                "Delete is XACK + XDEL in one MULTI/EXEC; a send of ten is ten XADDs in one "
                "MULTI/EXEC. Receive does not block (no BLOCK)."
            ),
        )
