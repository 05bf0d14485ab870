"""`shardq demo`: a replicated local cluster, a producer and a consumer, with a live
status line, and a server SIGKILLed part-way through.

It runs `shardq local up` (three servers, every shard on all three), sends and
consumes through a server it will not kill, then kills the leader of shard 0:
the supervisor fails its shards over to in-sync followers and restarts it,
while the producer and consumer keep going. One message in twenty makes the
handler fail, so retries with backoff and the dead-letter queue show up too.
Everything runs on 127.0.0.1 and is stopped by PID at the end (after
--duration, or on Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import click

from shard_server.local.cluster_files import LEASE_STORE_DIR
from shardq import event_loops
from shardq.aio import AsyncClient
from shardq.consumer import ConsumerStats, run_consumer
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.durations import parse_duration_ms
from shardq.errors import ShardqError
from shardq.types import QueueAttributes, ReceivedMessage

QUEUE = "demo"
DLQ = "demo-dlq"
SERVERS = 3
READY_TIMEOUT_S = 60
# Sends in flight at once: the rate holds even while one is waiting out a failover.
PRODUCER_WINDOW = 64
# After the producer stops, how long the consumer may take to empty the queue.
DRAIN_TIMEOUT_S = 30.0
QUEUE_SPEC = (
    f"{QUEUE}:shards=4,replicas=3,visibility=5s,dead_letter_queue={DLQ},max_receive_count=3,nack_backoff_base=200ms"
)


def _free_base_port() -> int:
    """A port p with p..p+SERVERS-1 and their metrics ports (p+2000...) all free."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + 2000 + SERVERS >= 65535:
            continue
        if all(_is_free(base + offset) and _is_free(base + 2000 + offset) for offset in range(SERVERS)):
            return base
    raise click.ClickException("found no free ports on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _status(data_dir: pathlib.Path) -> dict[str, object] | None:
    done = subprocess.run(
        [sys.executable, "-m", "shardq", "local", "status", "--data-dir", str(data_dir), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if done.returncode != 0:
        return None
    status: dict[str, object] = json.loads(done.stdout)
    return status


async def _wait_ready(data_dir: pathlib.Path, supervisor: subprocess.Popen[bytes]) -> dict[str, object]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if supervisor.poll() is not None:
            raise click.ClickException(f"`shardq local up` exited with code {supervisor.returncode}")
        status = await asyncio.to_thread(_status, data_dir)
        servers = status.get("servers", []) if status else []
        if isinstance(servers, list) and len(servers) == SERVERS and all(s.get("answering") for s in servers):
            assert status is not None
            return status
        await asyncio.sleep(0.3)
    raise click.ClickException("the cluster did not become ready in time")


async def _whole_counts(client: AsyncClient, queue: str) -> QueueAttributes | None:
    """The queue's counts if every shard's leader answered, else None. A server counts the
    shards led elsewhere by asking their leaders, and leaves out those it cannot reach (as
    for a moment after the demo's kill): such a partial count reads as fewer messages."""
    try:
        attributes = await asyncio.wait_for(client.attributes(queue), timeout=5)
    except (ShardqError, TimeoutError):
        return None
    return attributes if attributes.complete else None


async def _drain(client: AsyncClient, stop: asyncio.Event, *, timeout_s: float) -> bool:
    """Wait until nothing of the demo queue is left to handle (the DLQ keeps its own),
    `timeout_s` at most, or until Ctrl-C."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        attributes = await _whole_counts(client, QUEUE)
        if attributes is not None and (
            attributes.visible + attributes.in_flight + attributes.delayed + attributes.dead_letter_pending == 0
        ):
            return True
        await asyncio.sleep(0.5)
    return False


async def _dead_lettered(client: AsyncClient, *, within_s: float) -> str:
    """How many messages the DLQ holds, counted over all its shards (or why not)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        attributes = await _whole_counts(client, DLQ)
        if attributes is not None:
            return str(attributes.visible)
        await asyncio.sleep(0.5)
    return f"unknown (not every leader of {DLQ} answered within {within_s:.0f}s)"


def poisoned(number: int) -> bool:
    """The demo's handler fails every 20th message for good: those end in the DLQ."""
    return number % 20 == 7


def _leaders(leases: LocalLeaseStore) -> str:
    return " ".join(
        f"{lease.name.split('.')[-1]}:{lease.holder}@{lease.transitions}" for lease in leases.list(f"{QUEUE}.")
    )


async def _run_demo(
    data_dir: pathlib.Path, supervisor: subprocess.Popen[bytes], duration_s: float, rate: float
) -> None:
    status = await _wait_ready(data_dir, supervisor)
    servers = {str(s["server_id"]): s for s in status["servers"]}  # type: ignore[attr-defined]
    shards = {str(s["lease"]): s for s in status["shards"]}  # type: ignore[attr-defined]
    # The clients' server is one that does not lead shard 0 now; whoever leads a
    # shard (other than it) when the time comes is the one killed.
    survivor = next(server for server in sorted(servers) if server != str(shards[f"{QUEUE}.0"]["leader"]))
    endpoint = str(servers[survivor]["endpoint"])
    click.echo(
        f"clients use {survivor} ({endpoint}); at {duration_s / 3:.0f}s the leader of shard 0 gets SIGKILLed",
        err=True,
    )
    leases = LocalLeaseStore(data_dir / LEASE_STORE_DIR)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    sent = retries = 0
    # Message numbers: which sends were acknowledged, which a handler finished (before its
    # delete, whose answer a failover may lose), so the end can say whether any went missing.
    acknowledged: set[int] = set()
    handled: set[int] = set()
    latencies: list[float] = []
    consumer_stats = ConsumerStats()

    async with AsyncClient(endpoint) as client:

        async def produce() -> None:
            nonlocal sent, retries
            window = asyncio.Semaphore(PRODUCER_WINDOW)
            started = time.monotonic()
            issued = 0

            async def send_one(number: int) -> None:
                nonlocal sent, retries
                body = f"order {number} at {time.time():.3f}".encode()
                try:
                    while not stop.is_set() and time.monotonic() - started < duration_s + 10:
                        try:
                            await client.send(QUEUE, body, attributes={"n": str(number)})
                        except ShardqError:
                            retries += 1  # failing over: send it again shortly
                            await asyncio.sleep(0.2)
                            continue
                        sent += 1
                        acknowledged.add(number)
                        return
                finally:
                    window.release()

            in_flight: set[asyncio.Task[None]] = set()
            while not stop.is_set() and time.monotonic() - started < duration_s:
                await window.acquire()
                task = asyncio.create_task(send_one(issued))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                issued += 1
                ahead = issued / rate - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if in_flight:
                await asyncio.wait(set(in_flight), timeout=10)

        async def handle(message: ReceivedMessage) -> None:
            number = int(message.attributes.get("n", "0"))
            if poisoned(number):
                raise RuntimeError("simulated handler failure")
            latencies.append(time.time() * 1000 - message.sent_at_ms)
            handled.add(number)

        async def consume() -> None:
            while not stop.is_set():
                try:
                    await run_consumer(
                        client, QUEUE, handle, concurrency=64, stop=stop, handle_signals=False, stats=consumer_stats
                    )
                except ShardqError:
                    await asyncio.sleep(0.2)  # the stream broke during a failover: open a new one

        async def kill_a_leader() -> None:
            await asyncio.sleep(duration_s / 3)
            # Leadership may have moved since the start (off hot servers): ask again now.
            current = {lease.name: lease.holder for lease in await asyncio.to_thread(leases.list, f"{QUEUE}.")}
            shard, victim = next(
                ((name, holder) for name, holder in sorted(current.items()) if holder and holder != survivor),
                ("", ""),
            )
            now = await asyncio.to_thread(_status, data_dir)
            pids = {str(s["server_id"]): int(s["pid"]) for s in (now or {}).get("servers", [])}  # type: ignore[attr-defined]
            if not victim or victim not in pids:
                click.echo("*** no leader to kill but the clients' own server; skipping the kill", err=True)
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            click.echo(
                f"*** SIGKILLed {victim} (pid {pids[victim]}), the leader of shard {shard.rsplit('.', 1)[-1]}; "
                "the supervisor fails its shards over and restarts it",
                err=True,
            )
            while not stop.is_set():
                await asyncio.sleep(0.5)
                now = await asyncio.to_thread(_status, data_dir)
                for server in (now or {}).get("servers", []):  # type: ignore[attr-defined]
                    if server["server_id"] == victim and int(server["pid"]) != pids[victim] and server["answering"]:
                        click.echo(
                            f"*** the supervisor restarted {victim} (pid {server['pid']}) "
                            f"{time.monotonic() - killed_at:.1f}s after the kill",
                            err=True,
                        )
                        return

        async def report() -> None:
            while not stop.is_set():
                await asyncio.sleep(1)
                try:
                    stats = await client.attributes(QUEUE)
                    dead = await client.attributes(DLQ)
                except ShardqError:
                    continue
                recent = sorted(latencies[-500:])
                p50 = recent[len(recent) // 2] if recent else 0.0
                leaders = await asyncio.to_thread(_leaders, leases)
                uncounted = sorted({*stats.uncounted_shards, *dead.uncounted_shards})
                partial = f"  (counts leave out shard(s) {uncounted}: no leader answered)" if uncounted else ""
                click.echo(
                    f"sent {sent:>6}  handled {consumer_stats.handled:>6}  failed {consumer_stats.failed:>4}  "
                    f"visible {stats.visible:>4}  in-flight {stats.in_flight:>3}  dead-lettered {dead.visible:>3}  "
                    f"p50 {p50:6.1f} ms  leaders {leaders}{partial}",
                    err=True,
                )

        reporter = asyncio.create_task(report())
        killer = asyncio.create_task(kill_a_leader())
        consumer = asyncio.create_task(consume())
        await produce()
        # The producer is done: let the consumer drain what is left before stopping.
        drained = await _drain(client, stop, timeout_s=DRAIN_TIMEOUT_S)
        stop.set()
        await consumer
        reporter.cancel()
        killer.cancel()
        if drained:
            click.echo("drained: every message was handled or dead-lettered", err=True)
        else:
            click.echo(f"stopped after {DRAIN_TIMEOUT_S:.0f}s of draining; the rest stays queued", err=True)
        # Read after the drain: the last progress line may predate the last dead-lettering.
        dead_lettered = await _dead_lettered(client, within_s=DRAIN_TIMEOUT_S)
        click.echo(
            f"done: sent {sent}, handled {consumer_stats.handled}, dead-lettered {dead_lettered}, "
            f"failed attempts {consumer_stats.failed}, sends retried during failover {retries}"
        )
        if drained:
            # "handled" counts answered deletes: one applied while its answer was lost in
            # the failover is not in it, but its message was handled. Say so by number.
            handleable = {number for number in acknowledged if not poisoned(number)}
            missing = sorted(handleable - handled)
            if missing:
                raise click.ClickException(f"{len(missing)} acknowledged messages were never handled: {missing[:20]}")
            unanswered = len(handled) - consumer_stats.handled
            click.echo(
                f"checked: all {len(handleable)} acknowledged messages that could be handled were handled"
                + (f" ({unanswered} deletes applied but unanswered during the failover)" if unanswered > 0 else ""),
                err=True,
            )
    leases.close()


@click.command("demo")
@click.option("--duration", default="60s", show_default=True, help="how long the producer runs")
@click.option("--rate", default=200.0, show_default=True, help="messages per second")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None)
def demo_command(duration: str, rate: float, data_dir: pathlib.Path | None) -> None:
    """A replicated local cluster with a producer and a consumer; one server is killed midway."""
    duration_s = parse_duration_ms(duration) / 1000
    # The simulated failures are the point of the demo; their warnings are not.
    logging.getLogger("shardq.consumer").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="shardq-demo-") as scratch:
        directory = data_dir or pathlib.Path(scratch) / "cluster"
        log_path = pathlib.Path(scratch) / "supervisor.log"
        command = [
            sys.executable, "-m", "shardq", "local", "up", "--data-dir", str(directory),
            "--servers", str(SERVERS), "--base-port", str(_free_base_port()),
            "--queue", QUEUE_SPEC, "--queue", f"{DLQ}:replicas=3",
        ]  # fmt: skip
        with log_path.open("ab") as log_file:
            supervisor = subprocess.Popen(command, stdout=log_file, stderr=log_file)
        click.echo(f"supervisor pid {supervisor.pid}; cluster in {directory}; log {log_path}", err=True)
        try:
            event_loops.run(_run_demo(directory, supervisor, duration_s, rate))
        finally:
            if supervisor.poll() is None:
                supervisor.send_signal(signal.SIGTERM)
                try:
                    supervisor.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    supervisor.kill()
                    supervisor.wait()
