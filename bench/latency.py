"""Latency of single durable operations at the concurrency real services have.

One `shardq serve` (fsync on, a queue of --shards shards) on a free 127.0.0.1 port and
one AsyncClient in this process. For each concurrency C in --concurrency (default
1, 4, 16, 64), C callers each keep exactly one call in flight, and every call's latency
is recorded. Phases, in order, for each C:

  send1.unary      send_messages(queue, [1 message])
  send10.unary     send_messages(queue, [10 messages])
  send1.stream     send(queue, message): one message over the producer stream
  send10.stream    send_messages_streamed(queue, [10 messages]) over the producer stream
  receive.unary    receive_messages(max 10, no wait), keeping the receipts
  visibility.unary change_visibility of one receipt (to 60 s)
  delete.unary     delete_messages of one receipt
  delete.stream    a consumer stream's delete() of one receipt (one stream per caller,
                   granted no credits); since the eighteenth change the client's own
                   delete_messages, which the streams of one client share (README)
  worker           C consumers: receive up to 10, then delete each message, awaiting each
                   answer, from a queue filled for it beforehand (untimed); a call is one
                   receive and its deletes, and messages_per_s is what the loop delivers
  worker.stream    C consumers, each on its own consumer stream with 10 credits: take a
                   message, delete it with the stream's delete() awaiting the answer; a call
                   is one message, from asking for it to its delete being answered
  worker.shared    C consumers sharing one consumer stream with 10 credits each (10 x C),
                   as run_consumer's handlers do: each takes the stream's next message and
                   deletes it with the stream's delete() awaiting the answer; concurrent
                   deletes share requests; a call is one message, as in worker.stream
  worker.consumer  run_consumer with concurrency C (its default prefetch) and a handler that
                   returns at once: its C workers take, handle and delete; a call is one
                   message, its latency a worker's cycle, from one handler start to its next
  worker.pop       C consumers, each receiving one message at a time with delete_on_receive
                   (pgmq's pop: deleted in the receive's commit, at most once); a call is
                   one message
  worker.pop10     the same, up to 10 messages a call, as `worker` receives them

With C=4 the send and worker phases are the issue's "4 producers / 4 consumers, one call
in flight each". Each phase runs --ops calls in all (at least 4 per caller) or
--max-seconds, whichever comes first. Reported per phase: calls/s, p50 / p99 / p99.9 /
max latency, the CPU the server and this client process used per call (the server's also
split: its event-loop thread's, and its kernel time over all threads), and the server's
commits (from its /metrics, read before and after the phase): commits per call, their
mean time from start to durable, and requests per commit. The queue is drained between
concurrencies so each starts from an empty queue.

With --runs N the whole measurement runs N times, each on a fresh server, and each cell
reports the run with the median p50 (its other figures are that run's), with the p50 of
every run beside it: the machine varies, and one run can be unlucky.

Usage: python bench/latency.py [--concurrency 1,4,16,64] [--ops 2000] [--shards 4]
       [--phases send1.unary,...] [--runs 3] [--server-arg=--writer-threads=2]
       [--payload-bytes 256] [--out bench/results] [--label default]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]
import reports

from shardq import event_loops
from shardq.aio import AsyncClient
from shardq.consumer import run_consumer
from shardq.consumer_streams import ConsumerStream
from shardq.tls import CA_FILE_ENV
from shardq.types import Message, ReceivedMessage

MAX_SECONDS = 20.0
# The worker.stream consumers' prefetch: as much as one unary receive takes.
WORKER_STREAM_CREDITS = 10
PHASES = (
    "send1.unary",
    "send10.unary",
    "send1.stream",
    "send10.stream",
    "receive.unary",
    "visibility.unary",
    "delete.unary",
    "delete.stream",
    "worker",
    "worker.stream",
    "worker.shared",
    "worker.consumer",
    "worker.pop",
    "worker.pop10",
)


async def callers(
    concurrency: int, total: int, max_seconds: float, call: Callable[[int], Awaitable[int]]
) -> tuple[list[float], int]:
    """`concurrency` callers, each with one call in flight, until `total` calls (or time)
    are done; each call returns how many operations it did. Latencies and operations."""
    latencies: list[float] = []
    remaining = [total]
    done = [0]
    deadline = time.perf_counter() + max_seconds

    async def caller(number: int) -> None:
        while remaining[0] > 0 and time.perf_counter() < deadline:
            remaining[0] -= 1
            started = time.perf_counter()
            # Awaited first: `done[0] += await ...` would read done[0] before the await
            # and lose the other callers' counts.
            operations = await call(number)
            latencies.append(time.perf_counter() - started)
            done[0] += operations

    await asyncio.gather(*(caller(number) for number in range(concurrency)))
    return latencies, done[0]


def summarize(
    name: str,
    concurrency: int,
    meter: dataplane.Meter,
    latencies: list[float],
    operations: int,
    *,
    calls: int | None = None,
) -> dict[str, Any]:
    """`calls` defaults to one per latency (worker.consumer counts its messages instead)."""
    result = {"phase": name, "concurrency": concurrency, **dataplane.latency_summary(latencies)}
    report = meter.report(len(latencies) if calls is None else calls)
    result["calls_per_s"] = report["msgs_per_s"]
    result["operations"] = operations
    result["server_cpu_us_per_call"] = report["server_cpu_us_per_msg"]
    # Where the server's CPU went: its event-loop thread, and kernel time (all threads).
    result["server_loop_cpu_us_per_call"] = report["server_loop_cpu_us_per_msg"]
    result["server_system_cpu_us_per_call"] = report["server_system_cpu_us_per_msg"]
    result["client_cpu_us_per_call"] = report["client_cpu_us_per_msg"]
    result["spinner_cpu_us_per_call"] = report["spinner_cpu_us_per_msg"]
    # The server's commits in the cell: how many per call, how long each took to become
    # durable (mean), how many requests each folded (group commit).
    for figure in ("commits_per_msg", "commit_ms_mean", "requests_per_commit"):
        if figure in report:
            result[figure.replace("_per_msg", "_per_call")] = report[figure]
    if name.startswith("worker"):
        # Per message, not per call: what a worker loop delivers.
        result["messages_per_s"] = round(operations / meter.elapsed_s, 1) if meter.elapsed_s > 0 else 0.0
    print(
        f"[latency] C={concurrency:<3} {name:<17} {result['calls_per_s']:>9.1f}/s  "
        f"p50 {result.get('p50_ms', 0):7.2f} ms  p99 {result.get('p99_ms', 0):7.2f} ms  "
        f"p99.9 {result.get('p999_ms', 0):7.2f} ms  server {result['server_cpu_us_per_call']:7.0f} us/call"
        f" (loop {result['server_loop_cpu_us_per_call']:.0f}, system {result['server_system_cpu_us_per_call']:.0f})"
        + (f" + spinners {result['spinner_cpu_us_per_call']:.0f}" if result["spinner_cpu_us_per_call"] else "")
        + (f"  commit {result['commit_ms_mean']:.2f} ms" if result.get("commit_ms_mean") else ""),
        file=sys.stderr,
        flush=True,
    )
    return result


async def run_phase(
    name: str,
    concurrency: int,
    total: int,
    server: dataplane.Server,
    call: Callable[[int], Awaitable[int]],
) -> dict[str, Any]:
    meter = dataplane.Meter(server.process.pid, server.metrics_url)
    meter.start()
    latencies, operations = await callers(concurrency, total, MAX_SECONDS, call)
    meter.stop()
    return summarize(name, concurrency, meter, latencies, operations)


async def drain(client: AsyncClient, queue: str) -> None:
    while True:
        messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=0)
        if not messages:
            attributes = await client.attributes(queue)
            if attributes.visible + attributes.in_flight + attributes.delayed == 0:
                return
            await asyncio.sleep(0.05)
            continue
        await client.delete_messages(queue, [message.receipt for message in messages])


async def fill(client: AsyncClient, queue: str, payload: bytes, messages: int) -> None:
    """Untimed: `messages` messages in the queue, sent 10 at a time."""
    for start in range(0, messages, 10):
        await client.send_messages(queue, [Message(payload) for _ in range(min(10, messages - start))])


async def measure(
    args: argparse.Namespace, server: dataplane.Server, queue: str, phases: set[str]
) -> list[dict[str, Any]]:
    client = await dataplane.connect(server.endpoint)
    results: list[dict[str, Any]] = []
    try:
        for concurrency in args.concurrency:
            total = max(args.ops, 4 * concurrency)
            payload = b"x" * args.payload_bytes
            results += await measure_at(client, queue, payload, concurrency, total, server, phases)
            await drain(client, queue)
    finally:
        await client.close()
    return results


async def measure_at(
    client: AsyncClient,
    queue: str,
    payload: bytes,
    concurrency: int,
    total: int,
    server: dataplane.Server,
    phases: set[str],
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []

    async def send1(_: int) -> int:
        await client.send_messages(queue, [Message(payload)])
        return 1

    async def send10(_: int) -> int:
        await client.send_messages(queue, [Message(payload) for _ in range(10)])
        return 10

    async def send_stream(_: int) -> int:
        await client.send(queue, payload)
        return 1

    async def send10_stream(_: int) -> int:
        await client.send_messages_streamed(queue, [Message(payload) for _ in range(10)])
        return 10

    for name, call in (
        ("send1.unary", send1),
        ("send10.unary", send10),
        ("send1.stream", send_stream),
        ("send10.stream", send10_stream),
    ):
        if name in phases:
            results.append(await run_phase(name, concurrency, total, server, call))

    receipt_phases = {"receive.unary", "visibility.unary", "delete.unary", "delete.stream"}
    if phases & receipt_phases:
        # The receipt phases need messages: as many as they use, if the sends left fewer.
        # receive.unary claims 10 a call: run without the send phases before it, it once
        # found 2 per call filled, and most of its calls came back empty and cheap.
        needed = (10 if "receive.unary" in phases else 2) * total
        visible = (await client.attributes(queue)).visible
        await fill(client, queue, payload, max(0, needed - visible))
        results += await measure_receipt_phases(client, queue, concurrency, total, server, phases)
        await drain(client, queue)

    if "worker" in phases:
        worker_calls = max(total // 10, 2 * concurrency)
        await fill(client, queue, payload, 10 * worker_calls)

        async def work(_: int) -> int:
            messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=0)
            for message in messages:
                await client.delete_messages(queue, [message.receipt])
            return len(messages)

        results.append(await run_phase("worker", concurrency, worker_calls, server, work))
        await drain(client, queue)

    for name, per_call in (("worker.pop", 1), ("worker.pop10", 10)):
        if name not in phases:
            continue
        pops = max(total // per_call, 2 * concurrency)
        await fill(client, queue, payload, per_call * pops)

        async def pop(_: int, per_call: int = per_call) -> int:
            return len(await client.receive_messages(queue, max_messages=per_call, delete_on_receive=True))

        results.append(await run_phase(name, concurrency, pops, server, pop))
        await drain(client, queue)

    # The consumer loops, each over a queue filled for it (untimed) and drained after.
    consumer_loops: dict[str, Callable[[int], Awaitable[dict[str, Any]]]] = {
        "worker.stream": lambda messages: stream_workers(client, queue, concurrency, messages, server),
        "worker.shared": lambda messages: stream_workers(client, queue, concurrency, messages, server, shared=True),
        "worker.consumer": lambda messages: consumer_workers(client, queue, concurrency, messages, server),
    }
    for name, consume in consumer_loops.items():
        if name in phases:
            messages = max(total, 10 * concurrency)
            await fill(client, queue, payload, messages)
            results.append(await consume(messages))
            await drain(client, queue)
    return results


async def measure_receipt_phases(
    client: AsyncClient, queue: str, concurrency: int, total: int, server: dataplane.Server, phases: set[str]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    receipts: list[str] = []

    async def receive(_: int) -> int:
        messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=0)
        receipts.extend(message.receipt for message in messages)
        return len(messages)

    if "receive.unary" in phases:
        results.append(await run_phase("receive.unary", concurrency, total, server, receive))
    while len(receipts) < 2 * total:  # untimed: what the phases below use, if still missing
        taken = await receive(0)
        if not taken:
            break
    held = list(receipts)
    changed: list[str] = []

    async def visibility(_: int) -> int:
        receipt = held.pop()
        await client.change_visibility(queue, [(receipt, 60_000)])
        changed.append(receipt)
        return 1

    if "visibility.unary" in phases:
        results.append(await run_phase("visibility.unary", concurrency, min(total, len(held)), server, visibility))
    to_delete = changed + held

    async def delete(_: int) -> int:
        await client.delete_messages(queue, [to_delete.pop()])
        return 1

    if "delete.unary" in phases:
        results.append(await run_phase("delete.unary", concurrency, min(total, len(to_delete)), server, delete))
    if "delete.stream" in phases:
        async with contextlib.AsyncExitStack() as streams:
            # No credits: nothing is pushed to them (their deletes go as the client's).
            opened = [await streams.enter_async_context(client.consume(queue, credits=0)) for _ in range(concurrency)]

            async def delete_streamed(number: int) -> int:
                await opened[number].delete([to_delete.pop()])
                return 1

            results.append(
                await run_phase("delete.stream", concurrency, min(total, len(to_delete)), server, delete_streamed)
            )
    # Untimed: the claims left over.
    for start in range(0, len(to_delete), 10):
        await client.delete_messages(queue, to_delete[start : start + 10])
    return results


async def stream_workers(
    client: AsyncClient, queue: str, concurrency: int, messages: int, server: dataplane.Server, *, shared: bool = False
) -> dict[str, Any]:
    """worker.stream: `concurrency` consumers on their own consumer streams, each taking a
    message and deleting it with its stream's delete(), until `messages` are deleted (or time).
    worker.shared (`shared`): the consumers share one stream, as run_consumer's handlers do."""
    latencies: list[float] = []
    remaining = [messages]
    done = [0]
    finished = asyncio.Event()

    async def consume(stream: ConsumerStream, taking: AsyncIterator[ReceivedMessage], turn: asyncio.Lock) -> None:
        while True:
            asked = time.perf_counter()
            # One async generator per stream: consumers sharing it take turns asking.
            async with turn:
                message = await anext(taking, None)
            if message is None:
                return
            answer = await stream.delete([message.receipt])
            latencies.append(time.perf_counter() - asked)
            done[0] += sum(1 for entry in answer if entry.ok)
            remaining[0] -= 1
            if remaining[0] <= 0:
                finished.set()
                return

    credits = WORKER_STREAM_CREDITS * (concurrency if shared else 1)
    async with contextlib.AsyncExitStack() as streams:
        opened = [
            await streams.enter_async_context(client.consume(queue, credits=credits, max_batch=credits))
            for _ in range(1 if shared else concurrency)
        ]
        takers = [(stream, stream.messages(), asyncio.Lock()) for stream in opened]
        meter = dataplane.Meter(server.process.pid, server.metrics_url)
        meter.start()
        consumers = [asyncio.create_task(consume(*takers[number % len(takers)])) for number in range(concurrency)]
        # Consumers whose streams hold nothing more wait in messages(): they are
        # cancelled once every message is deleted (or the time is up).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), timeout=MAX_SECONDS)
        meter.stop()
        for consumer in consumers:
            consumer.cancel()
        outcomes = await asyncio.gather(*consumers, return_exceptions=True)
        failures = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
        if failures:
            raise failures[0]
        untaken = [message for stream in opened for message in await stream.close()]
    if untaken:  # prefetched, never taken: visible again for the drain that follows
        await client.change_visibility(queue, [(message.receipt, 0) for message in untaken])
    return summarize("worker.shared" if shared else "worker.stream", concurrency, meter, latencies, done[0])


async def consumer_workers(
    client: AsyncClient, queue: str, concurrency: int, messages: int, server: dataplane.Server
) -> dict[str, Any]:
    """worker.consumer: run_consumer's `concurrency` workers handle `messages` messages (or
    stop at the time limit); a call is one message. Latencies are a worker's cycles, from
    one handler start to its next: an async handler runs in its worker's task (a
    run_consumer that starts a task per message, as before its workers shared the stream,
    gives none, only rates and CPU)."""
    latencies: list[float] = []
    last_start: dict[asyncio.Task[Any] | None, float] = {}

    async def handler(message: ReceivedMessage) -> None:
        # An async handler runs in its worker's task, so the task names the worker.
        now = time.perf_counter()
        worker = asyncio.current_task()
        if worker in last_start:
            latencies.append(now - last_start[worker])
        last_start[worker] = now

    stop = asyncio.Event()
    timer = asyncio.get_running_loop().call_later(MAX_SECONDS, stop.set)
    meter = dataplane.Meter(server.process.pid, server.metrics_url)
    meter.start()
    stats = await run_consumer(
        client, queue, handler, concurrency=concurrency, stop=stop, handle_signals=False, max_messages=messages
    )
    meter.stop()
    timer.cancel()
    return summarize("worker.consumer", concurrency, meter, latencies, stats.handled, calls=stats.handled)


def median_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (phase, concurrency), the run with the median p50, and every run's p50."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        for result in run:
            cells.setdefault((result["phase"], result["concurrency"]), []).append(result)
    chosen = []
    for results in cells.values():
        ordered = sorted(results, key=lambda result: result.get("p50_ms", 0.0))
        median = dict(ordered[(len(ordered) - 1) // 2])
        median["p50_ms_of_runs"] = [result.get("p50_ms", 0.0) for result in results]
        chosen.append(median)
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 4, 16, 64],
        help="callers with one call in flight each, comma-separated",
    )
    parser.add_argument("--ops", type=int, default=2000, help="calls per phase (at least 4 per caller)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument(
        "--phases",
        type=lambda text: text.split(","),
        default=list(PHASES),
        help=f"comma-separated, of: {', '.join(PHASES)}",
    )
    parser.add_argument("--runs", type=int, default=1, help="whole measurements, each on a fresh server")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="passed to `shardq serve` (repeat it; --server-arg=--writer-threads=2)",
    )
    parser.add_argument(
        "--client-loop",
        choices=event_loops.CHOICES,
        default=event_loops.AUTO,
        help="this process's event loop (the server's: --server-arg=--event-loop=asyncio)",
    )
    parser.add_argument(
        "--ca-file",
        default=None,
        help="speak TLS, trusting these CA certificates (with --server-arg=--tls-cert-file=... and "
        "--server-arg=--tls-key-file=...)",
    )
    parser.add_argument("--label", default="default", help="names the output file latency-LABEL.json")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write latency-LABEL.json")
    parser.add_argument("--plot", action="store_true", help="with --out, also latency-LABEL.png: p50s and rates")
    args = parser.parse_args(argv)
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def run_once(args: argparse.Namespace, loads: list[list[float]]) -> list[dict[str, Any]]:
    """One whole measurement on a fresh server; appends the 1-minute load average before
    and after it to `loads` (the machine may be shared: the figures say how busy it was)."""
    loads.append([round(os.getloadavg()[0], 2)])
    try:
        return measure_on_fresh_server(args)
    finally:
        loads[-1].append(round(os.getloadavg()[0], 2))


def measure_on_fresh_server(args: argparse.Namespace) -> list[dict[str, Any]]:
    root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-latency-"))
    queue = "bench"
    server = dataplane.start_server(
        root / "data", f"{queue}:shards={args.shards}", None, extra_args=tuple(args.server_arg), metrics=True
    )
    try:
        return event_loops.run(measure(args, server, queue, set(args.phases)), choice=args.client_loop)
    finally:
        dataplane.stop_process(server.process)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ca_file:
        # Read by every client this process and its workers make (shardq.tls).
        os.environ[CA_FILE_ENV] = args.ca_file
    runs = []
    loads: list[list[float]] = []
    for number in range(args.runs):
        if args.runs > 1:
            print(f"[latency] run {number + 1} of {args.runs}", file=sys.stderr, flush=True)
        runs.append(run_once(args, loads))
    results = runs[0] if args.runs == 1 else median_runs(runs)
    report = {
        "benchmark": "latency",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": dataplane.git_revision(),
        "shards": args.shards,
        "payload_bytes": args.payload_bytes,
        "fsync": True,
        "runs": args.runs,
        "server_args": args.server_arg,
        "client_loop": event_loops.resolve(args.client_loop),
        # Both ends' gRPC I/O engine (shardq/grpc_io.py); empty: gRPC's default, the EventEngine.
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
        "load_average_before_after_each_run": loads,
        "results": results,
    }
    reports.emit(report, args.out, f"latency-{args.label}.json")
    if args.plot and args.out is not None:
        plot(args.out / f"latency-{args.label}.png", results)
    return 0


def plot(path: pathlib.Path, results: list[dict[str, Any]]) -> None:
    """Per concurrency, each phase's p50 (but `worker`'s, a receive and its ten deletes,
    which would dwarf the rest) beside its rate (messages per second for the worker
    loops, calls per second otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({cell["concurrency"] for cell in results})
    figure, axes = plt.subplots(len(concurrencies), 2, figsize=(13, 3.4 * len(concurrencies)), squeeze=False)
    for (latency_axis, rate_axis), concurrency in zip(axes, concurrencies, strict=True):
        cells = [cell for cell in results if cell["concurrency"] == concurrency]
        timed = [cell for cell in cells if cell["phase"] != "worker" and "p50_ms" in cell]
        for axis, chosen, values, label in (
            (latency_axis, timed, [cell["p50_ms"] for cell in timed], "p50 ms a call"),
            (rate_axis, cells, [cell.get("messages_per_s", cell["calls_per_s"]) for cell in cells], "per s"),
        ):
            axis.bar(range(len(chosen)), values)
            axis.set_xticks(range(len(chosen)), [cell["phase"] for cell in chosen], rotation=20, fontsize=8)
            axis.set_ylabel(label)
            axis.set_title(f"{concurrency} call(s) in flight: {label}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
