"""Data-plane benchmark: send and drain throughput, latency and CPU per message.

Starts a fresh `shardq serve` on a free 127.0.0.1 port with a temporary data
directory, then drives it from two client processes: process A runs the
producer tasks, process B the consumer tasks. Phases, in order:

  send.single.stream   AsyncClient.send, 1 message per call (batched onto the producer stream)
  send.single.unary    AsyncClient.send_messages, 1 message per unary call
  drain.unary          receive_messages(max 10) + delete_messages until both sends are drained
  send.batch10.stream  AsyncClient.send_messages_streamed, 10 messages per call
  send.batch10.unary   AsyncClient.send_messages, 10 messages per unary call
  drain.stream         consume() stream, deletes with its delete(), until both sends are drained

Each send phase sends --messages messages; each drain phase removes exactly what the
two send phases before it stored (a known count), then checks the queue is empty.

Usage: python bench/dataplane.py [--messages 50000] [--out bench/results] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import io
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import platform
import pstats
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]

from shardq.grpc_io import use_completion_queue_polling

# As the `shardq` command does for the servers: before anything here imports gRPC.
use_completion_queue_polling()

import grpc  # noqa: E402

from shardq import event_loops  # noqa: E402
from shardq.aio import CHANNEL_OPTIONS, AsyncClient  # noqa: E402
from shardq.errors import ShardqError  # noqa: E402
from shardq.tls import CA_FILE_ENV, aio_channel, client_tls  # noqa: E402
from shardq.types import Message, ReceivedMessage  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# The benchmarks share the tests' support code (one free-port probe, one /metrics reader);
# run as `python bench/latency.py`, the repository is not on the path.
sys.path.insert(0, str(REPO_ROOT))
from tests.integration.scraping import samples, scrape_text, values  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

PROFILED_SERVER = pathlib.Path(__file__).resolve().parent / "profiled_server.py"
LISTENING = re.compile(r"shardq: listening on (\S+):(\d+)")
SERVER_START_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 30.0
WORKER_START_TIMEOUT_S = 60.0
# Time allowed past a phase's --max-seconds for in-flight calls and teardown.
PHASE_GRACE_S = 30.0
MAX_RECEIVE_BATCH = 10
# The consumer-stream phase: the client's default credits and frame limit, and
# delete calls in flight per consumer (as the 10-message sends keep 16 calls).
STREAM_CREDITS = 400
STREAM_FRAME = 1000
STREAM_DELETE_WINDOW = 16
TOP_PROFILE_ROWS = 25

SEND_KINDS = ("send_single_stream", "send_single_unary", "send_batch_stream", "send_batch_unary")
DRAIN_KINDS = ("drain_unary", "drain_stream")


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseSpec:
    """Everything a worker process needs to run one phase."""

    name: str
    kind: str
    endpoint: str
    queue: str
    server_pid: int
    tasks: int
    messages: int
    batch_size: int
    window: int
    max_seconds: float
    payload_bytes: int
    seed: int
    receive_wait_ms: int = 0
    credits: int = STREAM_CREDITS
    # Messages per frame the server pushes on a consumer stream (ConsumeStart.max_batch).
    stream_frame: int = STREAM_FRAME


# -- measurement ----------------------------------------------------------------------


def cpu_times(stat: pathlib.Path) -> tuple[float, float]:
    """(user, system) CPU seconds from a /proc stat file: a process's (all its threads)
    or one thread's (/proc/<pid>/task/<tid>/stat)."""
    text = stat.read_text()
    fields = text[text.rindex(")") + 2 :].split()
    # Fields after "(comm)" start at field 3 (state); utime is field 14, stime 15.
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    return sum(cpu_times(pathlib.Path(f"/proc/{pid}/stat")))


@dataclasses.dataclass(frozen=True, slots=True)
class ServerCpu:
    """A server process's CPU seconds: in all, the kernel's part of them (all threads),
    and its first thread's, the event loop (the writer thread and gRPC's have the rest)."""

    total: float = 0.0
    system: float = 0.0
    loop: float = 0.0

    def __sub__(self, earlier: ServerCpu) -> ServerCpu:
        return ServerCpu(self.total - earlier.total, self.system - earlier.system, self.loop - earlier.loop)


def server_cpu(pid: int) -> ServerCpu:
    user, system = cpu_times(pathlib.Path(f"/proc/{pid}/stat"))
    return ServerCpu(user + system, system, sum(cpu_times(pathlib.Path(f"/proc/{pid}/task/{pid}/stat"))))


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started and still runs (a server's idle-polling spinners)."""
    children: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            children.extend(int(child) for child in (task / "children").read_text().split())
    return children


def children_cpu_seconds(pid: int) -> float:
    """CPU of the processes `pid` runs now: the spinners' CPU is the price of idle polling,
    and a server's own figure would leave it out."""
    total = 0.0
    for child in child_pids(pid):
        with contextlib.suppress(FileNotFoundError):
            total += process_cpu_seconds(child)
    return total


def own_cpu_seconds() -> float:
    """CPU of this process, every thread included (gRPC's core threads too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def latency_summary(samples: list[float]) -> dict[str, float | int]:
    """Nearest-rank percentiles of per-call latencies (seconds in, milliseconds out)."""
    if not samples:
        return {"calls": 0}
    ordered = sorted(samples)

    def rank(fraction: float) -> float:
        index = min(len(ordered) - 1, max(0, int(fraction * len(ordered) + 0.5) - 1))
        return round(ordered[index] * 1000, 3)

    return {
        "calls": len(ordered),
        "p50_ms": rank(0.50),
        "p99_ms": rank(0.99),
        "p999_ms": rank(0.999),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(sum(ordered) / len(ordered) * 1000, 3),
    }


@dataclasses.dataclass(slots=True)
class Meter:
    """Wall clock and CPU (this client process and the server) over the timed section;
    with `metrics_url` (the server's /metrics), also its commits: how many, how long
    each took to become durable on average, and how many requests each folded."""

    server_pid: int
    metrics_url: str | None = None
    started: float = 0.0
    client_cpu_start: float = 0.0
    server_cpu_start: ServerCpu = ServerCpu()
    children_cpu_start: float = 0.0
    elapsed_s: float = 0.0
    client_cpu_s: float = 0.0
    # The server's kernel part covers its syscalls: socket I/O, wake-ups, the storage's
    # writes and syncs.
    server_cpu: ServerCpu = ServerCpu()
    # The server's child processes (idle-polling spinners), apart from its own figure.
    children_cpu_s: float = 0.0
    commits_start: CommitTotals | None = None
    commits: CommitTotals | None = None

    def start(self) -> None:
        # Scraped outside the CPU window: the scrape's own work is not the calls'.
        self.commits_start = commit_totals(self.metrics_url) if self.metrics_url else None
        self.client_cpu_start = own_cpu_seconds()
        self.server_cpu_start = server_cpu(self.server_pid)
        self.children_cpu_start = children_cpu_seconds(self.server_pid)
        self.started = time.perf_counter()

    def stop(self, finished_at: float | None = None) -> None:
        self.elapsed_s = (finished_at or time.perf_counter()) - self.started
        self.client_cpu_s = own_cpu_seconds() - self.client_cpu_start
        self.server_cpu = server_cpu(self.server_pid) - self.server_cpu_start
        self.children_cpu_s = children_cpu_seconds(self.server_pid) - self.children_cpu_start
        if self.metrics_url and self.commits_start is not None:
            self.commits = commit_totals(self.metrics_url) - self.commits_start

    def report(self, messages: int) -> dict[str, Any]:
        per_message = 1e6 / messages if messages else 0.0
        commits = {} if self.commits is None else self.commits.report(messages)
        return {
            **commits,
            "elapsed_s": round(self.elapsed_s, 3),
            "msgs_per_s": round(messages / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0,
            "server_cpu_s": round(self.server_cpu.total, 3),
            "client_cpu_s": round(self.client_cpu_s, 3),
            "server_cpu_us_per_msg": round(self.server_cpu.total * per_message, 2),
            "server_loop_cpu_us_per_msg": round(self.server_cpu.loop * per_message, 2),
            "server_system_cpu_us_per_msg": round(self.server_cpu.system * per_message, 2),
            "client_cpu_us_per_msg": round(self.client_cpu_s * per_message, 2),
            "spinner_cpu_us_per_msg": round(self.children_cpu_s * per_message, 2),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class CommitTotals:
    """A server's commit counters, summed over its shards (shardq_commit_duration_seconds
    and shardq_commit_batch_requests)."""

    commits: float = 0.0
    seconds: float = 0.0
    requests: float = 0.0

    def __sub__(self, earlier: CommitTotals) -> CommitTotals:
        return CommitTotals(
            self.commits - earlier.commits, self.seconds - earlier.seconds, self.requests - earlier.requests
        )

    def report(self, messages: int) -> dict[str, float]:
        return {
            "commits_per_msg": round(self.commits / messages, 3) if messages else 0.0,
            "commit_ms_mean": round(self.seconds / self.commits * 1e3, 3) if self.commits else 0.0,
            "requests_per_commit": round(self.requests / self.commits, 2) if self.commits else 0.0,
        }


def commit_totals(metrics_url: str) -> CommitTotals:
    found = samples(scrape_text(metrics_url, os.environ.get(CA_FILE_ENV)))
    return CommitTotals(
        sum(values(found, "shardq_commit_duration_seconds_count")),
        sum(values(found, "shardq_commit_duration_seconds_sum")),
        sum(values(found, "shardq_commit_batch_requests_sum")),
    )


def split_evenly(total: int, parts: int) -> list[int]:
    share, extra = divmod(total, parts)
    return [share + (1 if index < extra else 0) for index in range(parts)]


# -- client side: runs in the worker processes --------------------------------------------


async def connect(endpoint: str) -> AsyncClient:
    """An AsyncClient on its own channel, connected before the clock starts; over TLS
    when the environment says so (SHARDQ_CA_FILE, as for any client)."""
    tls = client_tls()
    channel = aio_channel(endpoint, tls, CHANNEL_OPTIONS)
    await asyncio.wait_for(channel.channel_ready(), timeout=30)
    return AsyncClient(endpoint, channel=channel, tls=tls or False)


async def run_send_phase(spec: PhaseSpec) -> dict[str, Any]:
    """`spec.tasks` producers, each with `spec.window` calls in flight, until `spec.messages` are sent."""
    payload = random.Random(spec.seed).randbytes(spec.payload_bytes)
    message = Message(payload)
    clients = [await connect(spec.endpoint) for _ in range(spec.tasks)]
    latencies: list[float] = []
    counts = {"stored": 0, "failed": 0, "calls_failed": 0}
    errors: dict[str, int] = {}

    async def call(client: AsyncClient, count: int) -> tuple[int, int]:
        """One send call; (stored, not stored)."""
        if spec.kind == "send_single_stream":
            await client.send(spec.queue, payload)
            return 1, 0
        batch = [message] * count
        if spec.kind == "send_batch_stream":
            results = await client.send_messages_streamed(spec.queue, batch)
        else:
            results = await client.send_messages(spec.queue, batch)
        stored = sum(1 for result in results if result.ok)
        for result in results:
            if not result.ok:
                errors[result.error_reason] = errors.get(result.error_reason, 0) + 1
        return stored, len(results) - stored

    async def producer(client: AsyncClient, share: int, deadline: float) -> None:
        remaining = share

        async def lane() -> None:
            nonlocal remaining
            while remaining > 0 and time.perf_counter() < deadline:
                count = min(spec.batch_size, remaining)
                remaining -= count
                began = time.perf_counter()
                try:
                    stored, failed = await call(client, count)
                except ShardqError as error:
                    name = type(error).__name__
                    errors[name] = errors.get(name, 0) + 1
                    counts["calls_failed"] += 1
                    counts["failed"] += count
                    continue
                latencies.append(time.perf_counter() - began)
                counts["stored"] += stored
                counts["failed"] += failed

        await asyncio.gather(*(lane() for _ in range(spec.window)))

    meter = Meter(spec.server_pid)
    timed_out = False
    meter.start()
    deadline = meter.started + spec.max_seconds
    try:
        producers = (
            producer(c, s, deadline) for c, s in zip(clients, split_evenly(spec.messages, spec.tasks), strict=True)
        )
        await asyncio.wait_for(asyncio.gather(*producers), timeout=spec.max_seconds + PHASE_GRACE_S)
    except TimeoutError:
        timed_out = True
    meter.stop()
    for client in clients:
        await client.close()
    return {
        "phase": spec.name,
        "api": spec.kind,
        "messages": counts["stored"],
        "requested": spec.messages,
        "failed": counts["failed"],
        "failed_calls": counts["calls_failed"],
        "errors": errors,
        "messages_per_call": spec.batch_size,
        "producers": spec.tasks,
        "window_per_producer": spec.window,
        "hit_time_limit": timed_out or counts["stored"] + counts["failed"] < spec.messages,
        **meter.report(counts["stored"]),
        "latency": {"send": latency_summary(latencies)},
    }


@dataclasses.dataclass(slots=True)
class DrainProgress:
    """Shared by the consumer tasks of one drain phase (one event loop, no locks needed)."""

    target: int
    deleted: int = 0
    received: int = 0
    delete_failed: int = 0
    empty_receives: int = 0
    finished_at: float | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    seen: set[str] = dataclasses.field(default_factory=set)
    redelivered: int = 0

    def note_received(self, message_ids: list[str]) -> None:
        self.received += len(message_ids)
        for message_id in message_ids:
            if message_id in self.seen:
                self.redelivered += 1
            self.seen.add(message_id)

    def note_deleted(self, ok: int, failed: int) -> None:
        self.deleted += ok
        self.delete_failed += failed
        if self.deleted >= self.target and not self.done.is_set():
            self.finished_at = time.perf_counter()
            self.done.set()


async def run_drain_phase(spec: PhaseSpec) -> dict[str, Any]:
    """`spec.tasks` consumers receive up to 10 and delete them until `spec.messages` are deleted."""
    clients = [await connect(spec.endpoint) for _ in range(spec.tasks)]
    progress = DrainProgress(target=spec.messages)
    if spec.messages == 0:
        progress.done.set()
    receive_latencies: list[float] = []
    delete_latencies: list[float] = []
    meter = Meter(spec.server_pid)
    meter.start()
    deadline = meter.started + spec.max_seconds

    async def unary_consumer(client: AsyncClient) -> None:
        async def lane() -> None:
            while not progress.done.is_set() and time.perf_counter() < deadline:
                began = time.perf_counter()
                received = await client.receive_messages(
                    spec.queue, max_messages=MAX_RECEIVE_BATCH, wait_time_ms=spec.receive_wait_ms
                )
                receive_latencies.append(time.perf_counter() - began)
                if not received:
                    progress.empty_receives += 1
                    continue
                progress.note_received([m.message_id for m in received])
                began = time.perf_counter()
                results = await client.delete_messages(spec.queue, [m.receipt for m in received])
                delete_latencies.append(time.perf_counter() - began)
                ok = sum(1 for result in results if result.ok)
                progress.note_deleted(ok, len(results) - ok)

        await asyncio.gather(*(lane() for _ in range(spec.window)))

    async def stream_consumer(client: AsyncClient) -> None:
        # Bounded by the credits, so credits bound unacknowledged messages too: an
        # unbounded inbox let slow (replicated) deletes fall behind the visibility timeout.
        inbox: asyncio.Queue[ReceivedMessage] = asyncio.Queue(maxsize=spec.credits)
        # The consumer code sees one message at a time and deletes up to 10 per call;
        # how many messages share a frame on the wire is the stream's business.
        async with client.consume(spec.queue, credits=spec.credits, max_batch=spec.stream_frame) as stream:

            async def pump() -> None:
                async for message in stream.messages():
                    progress.note_received([message.message_id])
                    await inbox.put(message)

            async def deleter() -> None:
                while not progress.done.is_set():
                    batch = [await inbox.get()]
                    while len(batch) < MAX_RECEIVE_BATCH and not inbox.empty():
                        batch.append(inbox.get_nowait())
                    began = time.perf_counter()
                    results = await stream.delete([m.receipt for m in batch])
                    delete_latencies.append(time.perf_counter() - began)
                    ok = sum(1 for result in results if result.ok)
                    progress.note_deleted(ok, len(results) - ok)

            workers = [asyncio.create_task(pump())] + [asyncio.create_task(deleter()) for _ in range(spec.window)]
            try:
                remaining = max(0.0, deadline - time.perf_counter())
                waiter = asyncio.create_task(progress.done.wait())
                await asyncio.wait([waiter, *workers], timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                for worker in workers:
                    error = worker.exception() if worker.done() and not worker.cancelled() else None
                    if error is not None:
                        raise error
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

    consumer = unary_consumer if spec.kind == "drain_unary" else stream_consumer
    tasks = [asyncio.create_task(consumer(client)) for client in clients]
    timed_out = False
    try:
        await asyncio.wait_for(_until_done_or_failed(progress.done, tasks), timeout=spec.max_seconds + PHASE_GRACE_S)
    except TimeoutError:
        timed_out = True
    meter.stop(progress.finished_at)
    teardown_started = time.perf_counter()
    # Once the target is reached every consumer winds down by itself (closing its stream);
    # only stragglers past the grace period are cancelled.
    _, stragglers = await asyncio.wait(tasks, timeout=PHASE_GRACE_S)
    for task in stragglers:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [repr(o) for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
    teardown_s = time.perf_counter() - teardown_started
    attributes = await clients[0].attributes(spec.queue)
    hit_time_limit = timed_out or progress.deleted < spec.messages
    # Leftovers would skew every later phase: start the next one from an empty queue.
    purged = await clients[0].purge(spec.queue) if hit_time_limit else 0
    for client in clients:
        await client.close()
    ops = (
        {"receive": receive_latencies, "delete": delete_latencies}
        if spec.kind == "drain_unary"
        else {"delete_over_stream": delete_latencies}
    )
    return {
        "phase": spec.name,
        "api": spec.kind,
        "messages": progress.deleted,
        "requested": spec.messages,
        "received": progress.received,
        "redelivered": progress.redelivered,
        "delete_failed": progress.delete_failed,
        "empty_receives": progress.empty_receives,
        "consumers": spec.tasks,
        "window_per_consumer": spec.window,
        "hit_time_limit": hit_time_limit,
        "consumer_failures": failures,
        "teardown_s": round(teardown_s, 3),
        "left_in_queue": {
            "visible": attributes.visible,
            "in_flight": attributes.in_flight,
            "delayed": attributes.delayed,
            "purged_after": purged,
        },
        **meter.report(progress.deleted),
        "latency": {op: latency_summary(samples) for op, samples in ops.items()},
    }


async def _until_done_or_failed(done: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Return when the drain target is reached or every consumer has stopped."""
    waiter = asyncio.create_task(done.wait())
    pending: set[asyncio.Future[Any]] = {waiter, *tasks}
    while waiter in pending and len(pending) > 1:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


def worker_main(connection: multiprocessing.connection.Connection) -> None:
    """A client process: runs the phases it is handed, one at a time, until told to stop."""
    connection.send({"ready": os.getpid()})
    while (spec := connection.recv()) is not None:
        phase: Coroutine[Any, Any, dict[str, Any]] = (
            run_send_phase(spec) if spec.kind in SEND_KINDS else run_drain_phase(spec)
        )
        try:
            result = event_loops.run(phase, choice=event_loops.from_environment())
        except Exception as error:  # report any failure to the parent rather than dying silently
            result = {"phase": spec.name, "worker_error": repr(error)}
        connection.send(result)


# -- orchestration: the parent process -----------------------------------------------------


@dataclasses.dataclass(slots=True)
class Server:
    process: subprocess.Popen[bytes]
    endpoint: str
    log_path: pathlib.Path
    profile_path: pathlib.Path | None
    metrics_url: str | None = None


def start_server(
    data_dir: pathlib.Path,
    queue_option: str,
    profile_path: pathlib.Path | None,
    extra_args: tuple[str, ...] = (),
    *,
    launcher: tuple[str, ...] = ("-m", "shardq"),
    metrics: bool = False,
) -> Server:
    """`shardq serve` on a kernel-chosen port; ready once it prints its listening line.
    `extra_args` go to `shardq serve` as they are (e.g. --writer-threads 2); `launcher`
    is what Python runs in place of `-m shardq` (a script taking the same arguments);
    `metrics` serves /metrics on a free port too (Server.metrics_url)."""
    metrics_url = None
    if metrics:
        port = free_port()
        extra_args = (*extra_args, "--metrics-port", str(port))
        # A server given a certificate serves its metrics over TLS too.
        tls = any(arg.startswith("--tls-cert-file") for arg in extra_args)
        metrics_url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/metrics"
    log_path = data_dir.parent / "server.log"
    command = [sys.executable]
    if profile_path is not None:
        # Not `-m cProfile`: that sees only the main thread, and commits run on per-shard writer threads.
        command += [str(PROFILED_SERVER), str(profile_path)]
    else:
        command += list(launcher)
    command += ["serve", "--data-dir", str(data_dir), "--host", "127.0.0.1", "--port", "0"]
    command += ["--queue", queue_option, "--log-format", "text", *extra_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            return Server(process, f"{match.group(1)}:{match.group(2)}", log_path, profile_path, metrics_url)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    stop_process(process)
    raise RuntimeError(f"server did not start; log:\n{log_path.read_text(errors='replace')[-4000:]}")


def stop_process(process: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM (the server shuts down gracefully), SIGKILL past the deadline; the exit code."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=SERVER_STOP_TIMEOUT_S)
    return process.returncode


@dataclasses.dataclass(slots=True)
class Worker:
    role: str
    process: multiprocessing.process.BaseProcess
    connection: multiprocessing.connection.Connection

    def run(self, spec: PhaseSpec) -> dict[str, Any]:
        self.connection.send(spec)
        if not self.connection.poll(spec.max_seconds + 2 * PHASE_GRACE_S + 60):
            raise RuntimeError(f"{self.role} process did not finish phase {spec.name}")
        result: dict[str, Any] = self.connection.recv()
        if "worker_error" in result:
            raise RuntimeError(f"{self.role} process failed in {spec.name}: {result['worker_error']}")
        return result

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.connection.send(None)
        self.process.join(timeout=15)
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(timeout=15)


def start_worker(role: str) -> Worker:
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=worker_main, args=(child_end,), name=f"bench-{role}", daemon=True)
    process.start()
    child_end.close()
    if not parent_end.poll(WORKER_START_TIMEOUT_S):
        raise RuntimeError(f"{role} process did not start")
    parent_end.recv()
    return Worker(role, process, parent_end)


def phase_plan(args: argparse.Namespace, server: Server, queue: str) -> Iterator[tuple[str, PhaseSpec]]:
    """(role, spec) per phase; a drain's message count is filled in from what the sends stored."""
    common = {
        "endpoint": server.endpoint,
        "queue": queue,
        "server_pid": server.process.pid,
        "max_seconds": args.max_seconds,
        "payload_bytes": args.payload_bytes,
        "seed": args.seed,
    }
    sends = {
        "send.single.stream": ("send_single_stream", 1, args.stream_window),
        "send.single.unary": ("send_single_unary", 1, args.unary_window),
        "send.batch10.stream": ("send_batch_stream", 10, args.batch_window),
        "send.batch10.unary": ("send_batch_unary", 10, args.batch_window),
    }
    for name, (kind, batch_size, window) in sends.items():
        spec = PhaseSpec(
            name=name,
            kind=kind,
            tasks=args.producers,
            messages=args.messages,
            batch_size=batch_size,
            window=window,
            **common,
        )
        yield "producer", spec
        if name.endswith("single.unary"):
            yield (
                "consumer",
                PhaseSpec(
                    name="drain.unary",
                    kind="drain_unary",
                    tasks=args.consumers,
                    messages=0,
                    batch_size=MAX_RECEIVE_BATCH,
                    window=args.receive_window,
                    receive_wait_ms=args.receive_wait_ms,
                    **common,
                ),
            )
        elif name.endswith("batch10.unary"):
            yield (
                "consumer",
                PhaseSpec(
                    name="drain.stream",
                    kind="drain_stream",
                    tasks=args.consumers,
                    messages=0,
                    batch_size=MAX_RECEIVE_BATCH,
                    window=args.stream_delete_window,
                    credits=args.credits,
                    stream_frame=args.stream_frame,
                    **common,
                ),
            )


def git_revision() -> str:
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return revision + ("-dirty" if dirty else "")


def filesystem_type(path: pathlib.Path) -> str:
    """The type of the mount holding `path` (tmpfs would make fsync free)."""
    best, best_type = "", "unknown"
    resolved = str(path.resolve())
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) < 3 or len(parts[1]) < len(best):
            continue
        if resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/"):
            best, best_type = parts[1], parts[2]
    return best_type


def environment(data_root: pathlib.Path) -> dict[str, Any]:
    import google.protobuf
    import lmdb

    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "lmdb": lmdb.__version__,
        "shardq_revision": git_revision(),
        # Clients' loop (SHARDQ_EVENT_LOOP); the server's is `shardq serve --event-loop`, auto = uvloop.
        "client_event_loop": event_loops.resolve(event_loops.from_environment()),
        # Both ends' gRPC I/O engine (shardq/grpc_io.py); empty: gRPC's default, the EventEngine.
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
        "fsync": True,
        "fsync_note": "the server fsyncs every commit; there is no switch to turn it off",
        "data_dir_filesystem": filesystem_type(data_root),
    }


def print_profile(path: pathlib.Path) -> None:
    """The top functions by cumulative and by own time (all threads), then the writer threads alone."""
    threads_path = pathlib.Path(f"{path}.threads")
    views = [(path, "cumulative", "all threads"), (path, "tottime", "all threads")]
    if threads_path.exists():
        views.append((threads_path, "tottime", "non-main (writer) threads only"))
    for source, order, scope in views:
        buffer = io.StringIO()
        stats = pstats.Stats(str(source), stream=buffer)
        stats.strip_dirs().sort_stats(order).print_stats(TOP_PROFILE_ROWS)
        print(f"--- server profile, {scope}: top {TOP_PROFILE_ROWS} by {order} ---", file=sys.stderr)
        print(buffer.getvalue(), file=sys.stderr)


def progress_line(result: dict[str, Any]) -> str:
    latency = ", ".join(
        f"{op} p50 {s.get('p50_ms', '-')} ms p99 {s.get('p99_ms', '-')} ms" for op, s in result["latency"].items()
    )
    flag = "  (HIT TIME LIMIT)" if result["hit_time_limit"] else ""
    return (
        f"{result['phase']:<20} {result['messages']:>8} msgs in {result['elapsed_s']:>7.2f} s = "
        f"{result['msgs_per_s']:>9.1f} msg/s; cpu/msg server {result['server_cpu_us_per_msg']} us, "
        f"client {result['client_cpu_us_per_msg']} us; {latency}{flag}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-bench-", dir=args.data_root))
    queue = "bench"
    queue_option = f"{queue}:{args.queue_options}" if args.queue_options else queue
    profile_path = data_root / "server.prof" if args.profile else None
    report: dict[str, Any] = {
        "benchmark": "shardq-dataplane",
        "label": args.label,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "workload": {
            "messages_per_send_phase": args.messages,
            "payload_bytes": args.payload_bytes,
            "producers": args.producers,
            "consumers": args.consumers,
            "client_processes": {"A": f"{args.producers} producer tasks", "B": f"{args.consumers} consumer tasks"},
            "client_per_task": "each task has its own AsyncClient and gRPC channel",
            "queue": queue_option,
            "windows": {
                "send.single.stream": args.stream_window,
                "send.single.unary": args.unary_window,
                "send.batch10": args.batch_window,
                "drain.unary_receive_loops": args.receive_window,
                "drain.stream_deletes_in_flight": args.stream_delete_window,
            },
            "receive_wait_ms": args.receive_wait_ms,
            "stream_credits": args.credits,
            "stream_frame_messages": args.stream_frame,
            "stream_delete_batch": MAX_RECEIVE_BATCH,
            "max_seconds_per_phase": args.max_seconds,
            "server_profiled": args.profile,
            "server_args": args.server_arg,
        },
        "environment": environment(data_root),
        "phases": [],
    }
    server: Server | None = None
    workers: dict[str, Worker] = {}
    try:
        server = start_server(data_root / "data", queue_option, profile_path, extra_args=tuple(args.server_arg))
        report["server"] = {"endpoint": server.endpoint, "pid": server.process.pid}
        print(f"server pid {server.process.pid} on {server.endpoint}, data in {data_root}", file=sys.stderr)
        workers = {"producer": start_worker("producer"), "consumer": start_worker("consumer")}
        stored_since_drain = 0
        for role, planned in phase_plan(args, server, queue):
            spec = planned
            if role == "consumer":
                spec = dataclasses.replace(planned, messages=stored_since_drain)
                stored_since_drain = 0
            result = workers[role].run(spec)
            if role == "producer":
                stored_since_drain += result["messages"]
            report["phases"].append(result)
            print(progress_line(result), file=sys.stderr, flush=True)
        report["server"]["cpu_s_total"] = round(process_cpu_seconds(server.process.pid), 3)
    finally:
        for worker in workers.values():
            worker.stop()
        if server is not None:
            report.setdefault("server", {})["exit_code"] = stop_process(server.process)
        report["environment"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        if profile_path is not None and profile_path.exists():
            print_profile(profile_path)
            if args.keep_profile is not None:
                shutil.copyfile(profile_path, args.keep_profile)
                with contextlib.suppress(FileNotFoundError):
                    shutil.copyfile(f"{profile_path}.threads", f"{args.keep_profile}.threads")
                report["server"]["profile"] = str(args.keep_profile)
        elif profile_path is not None:
            print("server profile was not written (did the server exit cleanly?)", file=sys.stderr)
        if args.keep_data:
            print(f"kept {data_root}", file=sys.stderr)
        else:
            shutil.rmtree(data_root, ignore_errors=True)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000, help="messages per send phase")
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument("--producers", type=int, default=4, help="producer tasks in client process A")
    parser.add_argument("--consumers", type=int, default=4, help="consumer tasks in client process B")
    parser.add_argument("--stream-window", type=int, default=64, help="send() calls in flight per producer")
    parser.add_argument("--unary-window", type=int, default=16, help="unary 1-message sends in flight per producer")
    parser.add_argument("--batch-window", type=int, default=16, help="10-message sends in flight per producer")
    parser.add_argument("--receive-window", type=int, default=1, help="receive+delete loops per unary consumer")
    parser.add_argument("--receive-wait-ms", type=int, default=0, help="long-poll wait of unary receives")
    parser.add_argument(
        "--stream-delete-window",
        type=int,
        default=STREAM_DELETE_WINDOW,
        help="delete calls (of up to 10) in flight per stream consumer",
    )
    parser.add_argument(
        "--credits", type=int, default=STREAM_CREDITS, help="credits per consumer stream (the client's default)"
    )
    parser.add_argument(
        "--stream-frame",
        type=int,
        default=STREAM_FRAME,
        help="most messages per consumer-stream frame (max_batch; the default)",
    )
    parser.add_argument("--queue-options", default="shards=4", help="queue spec after 'bench:' for shardq serve")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time limit per phase")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="passed to `shardq serve` (repeat it; --server-arg=--event-loop=asyncio)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--label", default="single-node", help="names the output file dataplane-LABEL.json")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write dataplane-LABEL.json")
    parser.add_argument("--data-root", type=pathlib.Path, default=None, help="where the temp data dir goes")
    parser.add_argument("--keep-data", action="store_true", help="do not delete the temp data dir")
    parser.add_argument("--profile", action="store_true", help="run the server under cProfile (every thread)")
    parser.add_argument("--keep-profile", type=pathlib.Path, default=None, help="copy the .prof file here")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.producers < 1 or args.consumers < 1 or args.max_seconds <= 0:
        parser.error("--messages, --producers, --consumers and --max-seconds must be positive")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.label):
        parser.error("--label may only hold letters, digits, '.', '_' and '-'")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    reports.emit(report, args.out, f"dataplane-{args.label}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
