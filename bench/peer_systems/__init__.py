"""The queue systems `bench/peers.py` runs side by side, each behind the same small
interface, so every system gets exactly the same workload from the same harness.

Each module here names one system and has one entry point:

    running(workdir: pathlib.Path, queue: str) -> contextlib.AbstractContextManager[Running]

It starts the system's server as a child process on a free 127.0.0.1 port, with its data
under `workdir`, creates `queue` (durable: an acknowledged send is on disk, or as close to
it as the system allows, which `Running.durability` says), yields, and stops the server by
PID on the way out, whatever happened (`dataplane.stop_process`: SIGTERM, then SIGKILL). Nothing
is left running and nothing is written outside `workdir`.

The workload's three operations, SQS's shape, in each system's own idiom:

- send: store the given bodies (one or ten), answered once the system acknowledges them;
- receive: claim up to `max_messages` visible now (no long wait), hidden from other
  receivers for 30 s (or held unacknowledged, where the system has no timeout);
- delete: remove one received message, awaiting the system's answer where its protocol
  has one (`Running.notes` says where it has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import dataplane  # bench/dataplane.py: the bench directory is on sys.path

# The project's own port picker, below the ephemeral range a port-0 probe draws from.
from tests.support.ports import free_port as free_port

VISIBILITY_TIMEOUT_S = 30
STOP_WAIT_S = 10.0

C = TypeVar("C")


class PeerQueue(Protocol):
    """One caller's handle on the queue: each caller keeps one call in flight on it. A
    system whose client multiplexes (one connection per process, as its docs advise) may
    hand every caller a view of one shared client."""

    async def send(self, bodies: Sequence[bytes]) -> None: ...

    async def receive(self, max_messages: int) -> list[Any]:
        """Handles of the messages claimed ([] when none is visible now)."""
        ...

    async def delete(self, handle: Any) -> None: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Running:
    name: str
    version: str
    # What an acknowledged send means on disk (fsynced before the answer, or not).
    durability: str
    # The server's processes: their CPU, and their children's, is the server's CPU.
    pids: list[int]
    # A new handle for one caller.
    connect: Callable[[], Awaitable[PeerQueue]]
    # Where the workload differs on this system from the others (e.g. unanswered acks).
    notes: str = ""


def wait_for_port(port: int, *, process: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    """Until something accepts connections on 127.0.0.1:`port`; fail early if `process`
    exited. (Local ports only: the machine's proxy makes remote ports always 'open'.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it listened on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not listen on {port} within {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def child_process(
    command: Sequence[str], *, log: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`command` started with its output in the file `log`, stopped on the way out."""
    with open(log, "ab") as output:
        process = subprocess.Popen(
            list(command), stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield process
    finally:
        dataplane.stop_process(process)


class SharedConnection(Generic[C]):
    """A process's one client connection, for systems whose clients multiplex (NATS, AMQP):
    opened by the first handle, closed with the last. Kept per event loop: a connection
    belongs to the loop that opened it, and a harness may run several loops in turn
    inside one `running`."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[C]],
        *,
        close: Callable[[C], Awaitable[None]],
        is_closed: Callable[[C], bool],
    ) -> None:
        self._connect = connect
        self._close = close
        self._is_closed = is_closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._connection: C | None = None
        self._users = 0

    async def acquire(self) -> C:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._lock is None:
            # A connection left behind by an earlier, finished loop cannot be used (or
            # closed) from this one; its socket went with that loop.
            self._loop, self._lock, self._connection, self._users = loop, asyncio.Lock(), None, 0
        async with self._lock:
            if self._connection is None or self._is_closed(self._connection):
                self._connection = await self._connect()
            self._users += 1
            return self._connection

    async def release(self) -> None:
        if self._lock is None or self._loop is not asyncio.get_running_loop():
            return
        async with self._lock:
            self._users -= 1
            if self._users <= 0 and self._connection is not None:
                connection, self._connection, self._users = self._connection, None, 0
                await self._close(connection)
