"""NATS JetStream as a peer system: Debian's `nats-server` (2.9.x) with JetStream enabled,
one file-stored WorkQueue stream and one durable pull consumer shared by every caller.

Why these choices:

- A WorkQueue stream with one durable pull consumer with explicit acks is JetStream's
  queue: a fetched message stays pending (hidden from other fetches) for `ack_wait`
  (`VISIBILITY_TIMEOUT_S`, SQS's visibility timeout) and is redelivered if it is not acked
  by then; an ack removes it from the stream.
- File storage, the durable choice. The 2.9 server cannot fsync per message: its file
  store writes each message to the block file (a `write(2)`, flushed in place, no
  buffering in the server) before the PubAck, and fsyncs the block files from a timer
  every 2 minutes (hard-coded for streams in 2.9: `fsCfg.SyncInterval = 2 * time.Minute`
  in server/stream.go). The `jetstream { sync_interval: always }` option only came in
  2.10; this server refuses it ("unknown field"). So an acknowledged send survives a
  crash of the server process but not necessarily a crash of the machine (nor does an
  ack's removal: after a machine crash a deleted message may come back).
- One NATS connection per process, as NATS advises (it multiplexes everything over one
  socket): every caller's handle is a view of that connection, with its own pull
  subscription (its own reply inbox) bound to the shared durable consumer. Concurrent
  fetches on one subscription would share one inbox and take each other's messages
  and status replies, so NATS workers each fetch on their own subscription.
- Sends are `js.publish`, awaiting the PubAck. NATS has no batch publish: ten bodies are
  ten publishes in flight at once, all PubAcks awaited.
- Receives are a `fetch` of up to n on the caller's subscription. nats-py has no no-wait
  fetch, so an empty queue costs the fetch timeout (`FETCH_TIMEOUT_S`), and a fetch that
  timed out is followed by a look at the consumer's count of undelivered messages, so
  that [] means the queue has nothing visible, not that the machine was slow.
- Deletes are `msg.ack_sync()`: the double ack, which waits for the server to confirm
  the ack (a plain `ack()` is fire-and-forget).

What it runs: `nats-server -js -sd <workdir>/js -a 127.0.0.1 -p <free port>`, no config
file, monitoring off, as a child process stopped by PID on the way out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import pathlib
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from peer_systems import (
    VISIBILITY_TIMEOUT_S,
    PeerQueue,
    Running,
    SharedConnection,
    child_process,
    free_port,
    wait_for_port,
)

NAME = "nats"

START_TIMEOUT_S = 30.0
# The durable pull consumer every caller binds to.
CONSUMER = "workers"
# Far above anything the workload holds unacknowledged at once (callers x 10), so the
# consumer never stops handing out messages because too many are pending.
MAX_ACK_PENDING = 100_000
# How long an empty receive waits. nats-py's `fetch` has no no-wait option: it sends a
# pull request (its first one marked no_wait, but with an `expires`, which the 2.9 server
# treats as "wait until expires, return as soon as anything is there") and raises
# TimeoutError when nothing came within `timeout`. A non-empty fetch returns as soon as
# the server has handed over what it has, whatever this is; an empty one costs this
# long. It must cover a full round trip to the server on a loaded, shared 2-core
# machine (a too-short timeout returns [] while messages are there, and the server then
# delivers them to an abandoned request: they wait in this caller's inbox until its next
# fetch), and stay short enough to count as "no long wait": 20 ms.
FETCH_TIMEOUT_S = 0.02
# An empty fetch is retried while the consumer reports undelivered messages (others'
# fetches got there first, or the server was slow to answer), but never beyond this.
RECEIVE_BOUND_S = 1.0
# Per-request answers (PubAck, ack confirmation): generous, as a shared machine can
# stall; a real failure still surfaces.
REQUEST_TIMEOUT_S = 10.0

DURABILITY = (
    "JetStream file storage: each message is written to the stream's block file (write(2), "
    "not buffered in the server) before the PubAck, but fsynced only by a 2-minute timer "
    "(nats-server 2.9 has no per-message or configurable fsync; `sync_interval: always` "
    "came in 2.10 and this server refuses it): survives a server crash, not a machine crash"
)
NOTES = (
    "One NATS connection per process, as NATS advises: each caller is a view of it with its "
    "own pull subscription bound to one shared durable pull consumer (explicit ack, "
    f"ack_wait {VISIBILITY_TIMEOUT_S} s, max_ack_pending {MAX_ACK_PENDING}). "
    "NATS has no batch publish: a send of 10 bodies is 10 concurrent publishes, each awaiting "
    "its own PubAck. receive is a fetch of up to n; the client has no no-wait fetch, so an "
    f"empty receive waits {FETCH_TIMEOUT_S * 1000:.0f} ms (the fetch timeout), then asks the "
    "consumer whether anything is still undelivered (fetching again if so) before returning []. "
    "delete is ack_sync (double ack, the server's confirmation awaited). Messages, and the acks "
    "that remove them, reach the disk's cache at once but are fsynced every 2 minutes, not before "
    "the answer (see durability)."
)


def _stream_name(queue: str) -> str:
    # Stream names may not contain '.', '*', '>', whitespace or path separators; the queue
    # name itself stays the subject.
    return re.sub(r"[^A-Za-z0-9_-]", "_", queue)


def _run_in_fresh_loop(make: Callable[[], Coroutine[Any, Any, str]]) -> str:
    """Run a coroutine to completion on a new event loop in a worker thread, so that
    `running` works whether or not its caller already runs an event loop."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, make()).result()


async def _connect(url: str) -> NatsClient:
    # No reconnects: a server that went away is a failed run, not something to hide.
    return await nats.connect(url, allow_reconnect=False, connect_timeout=5)


async def _create_queue(url: str, queue: str) -> str:
    """Create the stream and the durable consumer; return the server's version."""
    nc = await _connect(url)
    try:
        js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        await js.add_stream(
            js_api.StreamConfig(
                name=_stream_name(queue),
                subjects=[queue],
                retention=js_api.RetentionPolicy.WORK_QUEUE,
                storage=js_api.StorageType.FILE,
                num_replicas=1,
            )
        )
        await js.add_consumer(
            _stream_name(queue),
            js_api.ConsumerConfig(
                durable_name=CONSUMER,
                ack_policy=js_api.AckPolicy.EXPLICIT,
                ack_wait=float(VISIBILITY_TIMEOUT_S),
                max_ack_pending=MAX_ACK_PENDING,
                deliver_policy=js_api.DeliverPolicy.ALL,
            ),
        )
        server = nc.connected_server_version
        return f"{server.major}.{server.minor}.{server.patch}"
    finally:
        await nc.close()


def _shared_connection(url: str) -> SharedConnection[NatsClient]:
    """The process's one connection, as the system advises (it multiplexes)."""

    async def close(connection: NatsClient) -> None:
        await connection.close()

    return SharedConnection(lambda: _connect(url), close=close, is_closed=lambda connection: connection.is_closed)


@dataclasses.dataclass
class _NatsQueue:
    """One caller's view: the shared connection, its own pull subscription."""

    shared: SharedConnection[NatsClient]
    js: JetStreamContext
    subject: str
    stream: str
    sub: JetStreamContext.PullSubscription

    async def send(self, bodies: Sequence[bytes]) -> None:
        # `stream=` makes the server check the subject belongs to that stream (no lookup).
        if len(bodies) == 1:
            await self.js.publish(self.subject, bodies[0], stream=self.stream)
            return
        # No batch publish in NATS: all in flight at once, every PubAck awaited.
        await asyncio.gather(*(self.js.publish(self.subject, body, stream=self.stream) for body in bodies))

    async def receive(self, max_messages: int) -> list[Any]:
        deadline = time.monotonic() + RECEIVE_BOUND_S
        while True:
            try:
                return list(await self.sub.fetch(batch=max_messages, timeout=FETCH_TIMEOUT_S))
            except TimeoutError:
                # nats-py's TimeoutError and FetchTimeoutError, and asyncio's, are all
                # the builtin TimeoutError.
                pass
            # Nothing came within the fetch timeout. [] must mean "nothing visible now"
            # (the harness ends a worker phase on it), not "the machine stalled for a
            # moment": ask the consumer whether any message still waits for delivery.
            info = await self.sub.consumer_info()
            if not info.num_pending or time.monotonic() > deadline:
                return []

    async def delete(self, handle: Any) -> None:
        msg: Msg = handle
        # The double ack: waits for the server to confirm it removed the message.
        await msg.ack_sync(timeout=REQUEST_TIMEOUT_S)

    async def close(self) -> None:
        # Messages this caller holds unacked stay pending until ack_wait, as in SQS.
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()
        await self.shared.release()


def _connector(url: str, queue: str) -> Callable[[], Awaitable[PeerQueue]]:
    shared = _shared_connection(url)
    stream = _stream_name(queue)

    async def connect() -> PeerQueue:
        nc = await shared.acquire()
        try:
            js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
            # Bind to the existing durable consumer: a new inbox subscription on the
            # shared connection, no consumer created.
            sub = await js.pull_subscribe_bind(durable=CONSUMER, stream=stream)
        except BaseException:
            await shared.release()
            raise
        return _NatsQueue(shared=shared, js=js, subject=queue, stream=stream, sub=sub)

    return connect


def _server_binary() -> str:
    path = shutil.which("nats-server")
    if path is None:
        raise RuntimeError("nats-server is not installed (Debian: apt-get install -y nats-server)")
    return path


@contextlib.contextmanager
def running(workdir: pathlib.Path, queue: str) -> Iterator[Running]:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    command = [
        _server_binary(),
        "-js",
        "-sd",
        str(workdir / "js"),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    with child_process(command, log=str(workdir / "nats-server.log")) as server:
        wait_for_port(port, process=server, timeout_s=START_TIMEOUT_S, what="nats-server")
        version = _run_in_fresh_loop(lambda: _create_queue(url, queue))
        yield Running(
            name=NAME,
            version=f"nats-server {version}",
            durability=DURABILITY,
            pids=[server.pid],
            connect=_connector(url, queue),
            notes=NOTES,
        )
