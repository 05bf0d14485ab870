"""RabbitMQ as a peer system: Debian's `rabbitmq-server` (3.10) with one durable quorum
queue, used the AMQP 0-9-1 way (publisher confirms, consumers with a prefetch window,
manual acks).

What it runs, all under `workdir` and on 127.0.0.1 only:

- its own `epmd` (the Erlang port mapper the node registers its name with), started in
  the foreground on a free port (ERL_EPMD_PORT), so it is a child with a known PID rather
  than the daemon `erl` would otherwise fork off and leave running; the node is told not
  to start one (`-start_epmd false`);
- the node, through the package's real start script
  (/usr/lib/rabbitmq/bin/rabbitmq-server, not the /usr/sbin wrapper, which `su`s to the
  `rabbitmq` user and writes to /var/log/rabbitmq), with every path in the environment:
  RABBITMQ_MNESIA_BASE, RABBITMQ_LOG_BASE, the config, advanced config, conf.d, plugins
  and env files (no plugins: no management), HOME (the Erlang cookie), ERL_CRASH_DUMP;
  a unique node name, the AMQP port, the distribution port bound to 127.0.0.1. Nothing
  in RabbitMQ 3.10's own start path refuses root: run as root, it just runs as root.
  Without RABBITMQ_ALLOW_INPUT the script stays in front of the Erlang VM, passes SIGTERM
  on and waits; the VM (beam.smp) is its child, found in /proc, and is stopped by PID
  (SIGTERM: RabbitMQ shuts down cleanly; SIGKILL if it takes too long).

Why a quorum queue: it is RabbitMQ's durable, replicated queue type (classic mirrored
queues are deprecated). A publish is a Raft command: the queue's Ra log writes it to the
node's write-ahead log and fdatasyncs the WAL (Ra's defaults, which RabbitMQ 3.10 keeps:
`wal_write_strategy` default, `wal_sync_method` datasync) before the entry counts as
written, and the publisher confirm goes out only once the entry is committed and applied,
that is after the fsync. This node is a one-member cluster, so the quorum is itself: on
disk here, not replicated.

The workload in AMQP's idiom:

- one connection per process (AMQP multiplexes channels over it), a channel per caller,
  with publisher confirms;
- send: persistent messages published to the queue, awaiting the confirm; ten bodies are
  ten publishes in flight at once, all confirms awaited (AMQP 0-9-1 has no batch publish);
- receive: not basic.get polling but a consumer on the caller's channel, prefetch 10,
  manual acks, filling a local buffer; receive(n) hands back up to n already delivered.
  With none buffered it waits a few ms for a delivery, then asks the broker (a passive
  queue.declare) whether any message is ready: if so it keeps waiting (a quorum queue
  refills a consumer's window only once the acks, Raft commands, are applied), if not it
  returns [], so that [] means "nothing visible", which the harness relies on. Then it
  also cancels its consumer, started again by its next receive: an idle caller (the
  harness keeps helpers open between phases) would otherwise hold up to 10 messages
  prefetched, invisible to the callers that do receive;
- delete: basic.ack, which the broker never answers: it is written to the socket, not
  awaited as the other systems' deletes are.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any

import aio_pika
import aio_pika.abc

from peer_systems import (
    STOP_WAIT_S,
    VISIBILITY_TIMEOUT_S,
    PeerQueue,
    Running,
    SharedConnection,
    child_process,
    free_port,
    wait_for_port,
)

NAME = "rabbitmq"

# The package's start script itself; /usr/sbin/rabbitmq-server is a wrapper that su's to
# the rabbitmq user and logs to /var/log/rabbitmq.
SERVER_SCRIPT = pathlib.Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
EPMD = "epmd"
# Boot, until a quorum queue can be declared: tens of seconds on a loaded machine.
START_TIMEOUT_S = 90.0
# The graceful shutdown (SIGTERM) stops every queue and flushes: give it time.
VM_STOP_WAIT_S = 3 * STOP_WAIT_S
# Unacknowledged messages the broker hands one consumer at a time: a caller claims at
# most ten, as an SQS receive does.
PREFETCH = 10
# How long a receive with nothing buffered waits for a delivery before asking the broker
# whether anything is ready at all. Deliveries are pushed: once messages are ready and the
# caller has room in its window they arrive within a round trip. The common case of an
# empty buffer is a caller that just acked its whole window: a quorum queue frees the
# window only when the acks (Raft commands, fsynced) are applied, then sends the next
# messages, a few ms later. 5 ms covers that on a quiet machine without making an empty
# queue slow to report; when it does not, the passive declare that follows tells a slow
# refill (messages ready: wait on) from an empty queue.
FIRST_DELIVERY_WAIT_S = 0.005
# Bound on a receive that keeps hearing "messages ready" but gets none (others' consumers
# took them first): it returns [] after this.
RECEIVE_BOUND_S = 1.0
REQUEST_TIMEOUT_S = 30.0

DURABILITY = (
    "quorum queue (single-node Raft, so not replicated), persistent messages, publisher confirms: "
    "each publish is written to the Ra write-ahead log and fdatasynced (one fdatasync per WAL batch, "
    "shared by concurrent publishes) before the confirm is sent; acks are Raft commands fsynced the same way"
)
NOTES = (
    "AMQP 0-9-1: one connection per process, one channel per caller (publisher confirms on). "
    "No batch publish: a send of 10 is 10 concurrent publishes, each awaiting its confirm. "
    f"receive is a consumer with prefetch {PREFETCH} and manual acks feeding a local buffer, not "
    "basic.get: it returns what the broker has already pushed, waiting "
    f"{FIRST_DELIVERY_WAIT_S * 1000:.0f} ms for a first delivery when the buffer is empty and then "
    "asking the broker (passive queue.declare) whether any message is ready; when none is, the "
    "consumer is cancelled (restarted by the next receive) so that an idle caller does not keep "
    "up to 10 messages prefetched away from the others. delete is basic.ack, which the broker "
    "never answers: it is written to the socket, not awaited as on the other systems. "
    "No visibility timeout: a received message stays with its channel until acked or the channel "
    f"closes (then it is requeued), not {VISIBILITY_TIMEOUT_S} s (3.10 closes a channel holding one "
    "for over 30 minutes, consumer_timeout)."
)


def _run_in_fresh_loop(make: Callable[[], Coroutine[Any, Any, str]]) -> str:
    """Run a coroutine to completion on a new event loop in a worker thread, so that
    `running` works whether or not its caller already runs an event loop."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, make()).result()


async def _connect(url: str) -> aio_pika.abc.AbstractConnection:
    # A plain connection, not connect_robust: a broker that went away is a failed run,
    # not something to reconnect around.
    return await aio_pika.connect(url, timeout=REQUEST_TIMEOUT_S)


async def _declare(channel: aio_pika.abc.AbstractChannel, queue: str) -> aio_pika.abc.AbstractQueue:
    return await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})


async def _create_queue(url: str, queue: str) -> str:
    """Declare the quorum queue; return the broker's version. That the declare succeeds is
    the readiness check: the AMQP port opens before every subsystem is up."""
    connection = await _connect(url)
    try:
        channel = await connection.channel()
        await _declare(channel, queue)
        transport = connection.transport
        if transport is None:
            raise RuntimeError("the AMQP connection closed during setup")
        properties = transport.connection.server_properties
        version = properties.get("version", "?")
        platform = properties.get("platform", "")
        return f"RabbitMQ {version!s}" + (f" on {platform!s}" if platform else "")
    finally:
        await connection.close()


def _shared_connection(url: str) -> SharedConnection[aio_pika.abc.AbstractConnection]:
    """The process's one connection, as the system advises (it multiplexes)."""

    async def close(connection: aio_pika.abc.AbstractConnection) -> None:
        await connection.close()

    return SharedConnection(lambda: _connect(url), close=close, is_closed=lambda connection: connection.is_closed)


class _AmqpQueue:
    """One caller's channel: publishes with confirms, and a consumer feeding a buffer."""

    def __init__(
        self,
        shared: SharedConnection[aio_pika.abc.AbstractConnection],
        channel: aio_pika.abc.AbstractChannel,
        queue: aio_pika.abc.AbstractQueue,
    ) -> None:
        self._shared = shared
        self._channel = channel
        self._queue = queue
        self._buffer: collections.deque[aio_pika.abc.AbstractIncomingMessage] = collections.deque()
        self._arrived = asyncio.Event()
        self._consumer_tag: str | None = None
        # Delivered to this channel and not yet acked (buffered or handed to the caller):
        # the broker sends no more while this is at the prefetch count.
        self._unacked = 0

    async def send(self, bodies: Sequence[bytes]) -> None:
        exchange = self._channel.default_exchange
        routing_key = self._queue.name
        # Each publish returns once the broker's confirm for it arrived (the channel has
        # publisher confirms on); a nack or an unroutable message raises.
        publishes = [
            exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=routing_key,
                timeout=REQUEST_TIMEOUT_S,
            )
            for body in bodies
        ]
        if len(publishes) == 1:
            await publishes[0]
        else:
            await asyncio.gather(*publishes)

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self._unacked += 1
        self._buffer.append(message)
        self._arrived.set()

    async def _ready_in_queue(self) -> int:
        # A passive declare answers with the number of messages ready (not counting those
        # delivered and unacked): one round trip.
        declared = await self._channel.declare_queue(self._queue.name, passive=True)
        result = declared.declaration_result
        return int(result.message_count or 0) if result is not None else 0

    async def _await_delivery(self) -> None:
        """Until something is buffered, or there is nothing to wait for."""
        if self._consumer_tag is None:
            self._consumer_tag = await self._queue.consume(self._on_message, no_ack=False)
        deadline = time.monotonic() + RECEIVE_BOUND_S
        while not self._buffer:
            if self._unacked >= PREFETCH:
                # The whole window is with the caller, unacked: no delivery can come.
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), FIRST_DELIVERY_WAIT_S)
                continue
            # Nothing pushed within the wait. [] must mean "nothing visible now" (the
            # harness ends a worker phase on it), not "the acks are still being applied".
            if not await self._ready_in_queue() or time.monotonic() > deadline:
                # Idle: stop consuming, so that messages sent while this caller does
                # nothing go to callers that receive. Deliveries the broker sent before
                # its cancel-ok still land in the buffer, for the next receive.
                tag, self._consumer_tag = self._consumer_tag, None
                if tag is not None:
                    await self._queue.cancel(tag, timeout=REQUEST_TIMEOUT_S)
                return

    async def receive(self, max_messages: int) -> list[Any]:
        if not self._buffer:
            await self._await_delivery()
        taken: list[Any] = []
        while self._buffer and len(taken) < max_messages:
            taken.append(self._buffer.popleft())
        return taken

    async def delete(self, handle: Any) -> None:
        message: aio_pika.abc.AbstractIncomingMessage = handle
        # basic.ack has no answer in AMQP 0-9-1: this returns once the frame is written.
        await message.ack()
        self._unacked -= 1

    async def close(self) -> None:
        # Closing the channel cancels its consumer and requeues whatever it holds unacked.
        try:
            with contextlib.suppress(Exception):
                await self._channel.close()
        finally:
            await self._shared.release()


def _connector(url: str, queue: str) -> Callable[[], Awaitable[PeerQueue]]:
    shared = _shared_connection(url)

    async def connect() -> PeerQueue:
        connection = await shared.acquire()
        try:
            # on_return_raises: a publish the broker cannot route fails instead of
            # passing silently.
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            await channel.set_qos(prefetch_count=PREFETCH)
            amqp_queue = await channel.get_queue(queue, ensure=True)
        except BaseException:
            await shared.release()
            raise
        return _AmqpQueue(shared, channel, amqp_queue)

    return connect


def _proc_start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat): with the PID, its identity."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, not yet reaped: gone for our purposes
        return None
    return fields[19]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.extend(int(child) for child in (task / "children").read_text().split())
    return found


def _descendants(pid: int) -> list[tuple[int, str]]:
    """Every live process under `pid`, each with its start time."""
    found: list[tuple[int, str]] = []
    parents = [pid]
    while parents:
        for child in _children(parents.pop()):
            started = _proc_start_time(child)
            if started is not None:
                found.append((child, started))
                parents.append(child)
    return found


def _is_vm(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().startswith("beam")
    except OSError:
        return False


def _find_vm(script: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The Erlang VM's PID: the start script's child (`erl` execs erlexec, which execs
    beam.smp, so the VM keeps the PID the script forked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in _children(script.pid):
            if _is_vm(pid):
                return pid
        if script.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {script.returncode} before its Erlang VM started")
        if time.monotonic() > deadline:
            raise TimeoutError("rabbitmq-server's Erlang VM did not appear")
        time.sleep(0.05)


def _stop_node(script: subprocess.Popen[bytes]) -> None:
    """SIGTERM the VM (RabbitMQ stops cleanly on it), wait, SIGKILL what is left of it and
    of anything it started; the script then exits by itself (child_process reaps it)."""
    processes = _descendants(script.pid)
    for pid, started in processes:
        if _proc_start_time(pid) == started and _is_vm(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + VM_STOP_WAIT_S
    while time.monotonic() < deadline and any(_proc_start_time(pid) == started for pid, started in processes):
        time.sleep(0.1)
    for pid, started in processes:
        # Checked just before: the PID is still the process we saw, not a reused one.
        if _proc_start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _write_config(workdir: pathlib.Path) -> dict[str, pathlib.Path]:
    paths = {
        "config": workdir / "rabbitmq.conf",
        "plugins": workdir / "enabled_plugins",
        "mnesia": workdir / "mnesia",
        "log": workdir / "log",
        "home": workdir / "home",
    }
    for key in ("mnesia", "log", "home"):
        paths[key].mkdir(parents=True, exist_ok=True)
    # Only what differs from the defaults; the listener comes from the environment.
    paths["config"].write_text(
        "# bench/peer_systems/rabbitmq_quorum.py: a throwaway node for the peers benchmark\n"
        "log.file.level = info\n"
        "log.console = false\n"
    )
    # No plugins at all (the package enables none either; management would cost CPU).
    paths["plugins"].write_text("[].\n")
    return paths


@contextlib.contextmanager
def running(workdir: pathlib.Path, queue: str) -> Iterator[Running]:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if not SERVER_SCRIPT.exists() or shutil.which(EPMD) is None:
        raise RuntimeError("rabbitmq-server is not installed (Debian: apt-get install -y rabbitmq-server)")
    paths = _write_config(workdir)
    amqp_port, dist_port, epmd_port = free_port(), free_port(), free_port()
    node = f"bench-{os.getpid()}-{amqp_port}@localhost"
    url = f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
    env = {
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "RABBITMQ_MNESIA_BASE": str(paths["mnesia"]),
        "RABBITMQ_LOG_BASE": str(paths["log"]),
        "RABBITMQ_PID_FILE": str(workdir / "rabbitmq.pid"),
        "RABBITMQ_CONFIG_FILE": str(paths["config"]),
        # Neither conf.d, advanced.config nor rabbitmq-env.conf exist under workdir:
        # pointing there keeps /etc/rabbitmq's out.
        "RABBITMQ_CONFIG_FILES": str(workdir / "conf.d" / "*.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
        "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(paths["plugins"]),
        # The Erlang cookie is created in $HOME; crash dumps go to the working directory
        # unless told otherwise.
        "HOME": str(paths["home"]),
        "ERL_CRASH_DUMP": str(workdir / "erl_crash.dump"),
        # Our epmd is already up: the VM must not fork its own daemon. Distribution only
        # on the loopback interface.
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}",
    }
    # epmd in the foreground (no -daemon): our child, stopped by PID on the way out.
    epmd_command = [EPMD, "-port", str(epmd_port), "-address", "127.0.0.1"]
    with child_process(epmd_command, log=str(workdir / "epmd.log"), env={"ERL_EPMD_PORT": str(epmd_port)}) as epmd:
        wait_for_port(epmd_port, process=epmd, timeout_s=START_TIMEOUT_S, what="epmd")
        with child_process([str(SERVER_SCRIPT)], log=str(workdir / "rabbitmq-server.log"), env=env) as script:
            try:
                started = time.monotonic()
                wait_for_port(amqp_port, process=script, timeout_s=START_TIMEOUT_S, what="rabbitmq-server")
                vm = _find_vm(script, timeout_s=START_TIMEOUT_S)
                version = _declare_when_ready(url, queue, script, deadline=started + START_TIMEOUT_S)
                yield Running(
                    name=NAME,
                    version=version,
                    durability=DURABILITY,
                    # The VM and epmd; not the start script, a shell waiting on the VM
                    # (its CPU would be the VM's again once the VM is reaped).
                    pids=[vm, epmd.pid],
                    connect=_connector(url, queue),
                    notes=NOTES,
                )
            finally:
                _stop_node(script)


def _declare_when_ready(url: str, queue: str, script: subprocess.Popen[bytes], deadline: float) -> str:
    while True:
        try:
            return _run_in_fresh_loop(lambda: _create_queue(url, queue))
        except Exception as error:
            if script.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {script.returncode} while booting") from error
            if time.monotonic() > deadline:
                raise TimeoutError(f"RabbitMQ could not declare {queue!r} within {START_TIMEOUT_S:.0f} s") from error
            time.sleep(0.5)
