"""Latency of single durable operations at the concurrency real services have.

One `shardq serve` (fsync on, a queue of --shards shards) on a free 127.0.0.1 port and
one AsyncClient in this process. For each concurrency C in --concurrency (default
1, 4, 16, 64), C callers each keep exactly one call in flight, and every call's latency
is recorded. Phases, in order, for each C:

  send1.unary     send_messages(queue, [1 message])
  send10.unary    send_messages(queue, [10 messages])
  send1.stream    send(queue, message): one message over the producer stream
  receive.unary   receive_messages(max 10, no wait), keeping the receipts
  visibility.unary change_visibility of one receipt (to 60 s)
  delete.unary    delete_messages of one receipt
  worker          C consumers: receive up to 10, then delete each message, awaiting each
                  answer, from a queue filled for it beforehand (untimed); a call is one
                  receive and its deletes, and messages_per_s is what the loop delivers

Each phase runs --ops calls in all (at least 4 per caller) or --max-seconds, whichever
comes first. Reported per phase: calls/s, p50 / p99 / p99.9 / max latency, and the CPU
the server and this client process used per call. The queue is drained between
concurrencies so each starts from an empty queue.

Usage: python bench/latency.py [--concurrency 1,4,16,64] [--ops 2000] [--shards 4]
       [--payload-bytes 256] [--out bench/results] [--label default]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]

from shardq.aio import AsyncClient
from shardq.types import Message

MAX_SECONDS = 20.0


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


async def run_phase(
    name: str,
    concurrency: int,
    total: int,
    server_pid: int,
    call: Callable[[int], Awaitable[int]],
) -> dict[str, Any]:
    meter = dataplane.Meter(server_pid)
    meter.start()
    latencies, operations = await callers(concurrency, total, MAX_SECONDS, call)
    meter.stop()
    result = {"phase": name, "concurrency": concurrency, **dataplane.latency_summary(latencies)}
    report = meter.report(len(latencies))
    result["calls_per_s"] = report["msgs_per_s"]
    result["operations"] = operations
    result["server_cpu_us_per_call"] = report["server_cpu_us_per_msg"]
    result["client_cpu_us_per_call"] = report["client_cpu_us_per_msg"]
    print(
        f"[latency] C={concurrency:<3} {name:<17} {result['calls_per_s']:>9.1f}/s  "
        f"p50 {result.get('p50_ms', 0):7.2f} ms  p99 {result.get('p99_ms', 0):7.2f} ms  "
        f"p99.9 {result.get('p999_ms', 0):7.2f} ms  server {result['server_cpu_us_per_call']:7.0f} us/call",
        file=sys.stderr,
        flush=True,
    )
    return result


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


async def measure(args: argparse.Namespace, server: dataplane.Server, queue: str) -> list[dict[str, Any]]:
    client = await dataplane.connect(server.endpoint)
    results: list[dict[str, Any]] = []
    try:
        for concurrency in args.concurrency:
            total = max(args.ops, 4 * concurrency)
            results += await measure_at(client, queue, b"x" * args.payload_bytes, concurrency, total, server)
            await drain(client, queue)
    finally:
        await client.close()
    return results


async def measure_at(
    client: AsyncClient, queue: str, payload: bytes, concurrency: int, total: int, server: dataplane.Server
) -> list[dict[str, Any]]:
    pid = server.process.pid
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

    results.append(await run_phase("send1.unary", concurrency, total, pid, send1))
    results.append(await run_phase("send10.unary", concurrency, total, pid, send10))
    results.append(await run_phase("send1.stream", concurrency, total, pid, send_stream))

    receipts: list[str] = []

    async def receive(_: int) -> int:
        messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=0)
        receipts.extend(message.receipt for message in messages)
        return len(messages)

    results.append(await run_phase("receive.unary", concurrency, total, pid, receive))
    held = list(receipts)
    changed: list[str] = []

    async def visibility(_: int) -> int:
        receipt = held.pop()
        await client.change_visibility(queue, [(receipt, 60_000)])
        changed.append(receipt)
        return 1

    results.append(await run_phase("visibility.unary", concurrency, min(total, len(held)), pid, visibility))
    to_delete = changed + held

    async def delete(_: int) -> int:
        await client.delete_messages(queue, [to_delete.pop()])
        return 1

    results.append(await run_phase("delete.unary", concurrency, min(total, len(to_delete)), pid, delete))
    # Untimed: the claims left over, then a queue of exactly what the worker phase takes.
    for start in range(0, len(to_delete), 10):
        await client.delete_messages(queue, to_delete[start : start + 10])
    await drain(client, queue)
    worker_calls = max(total // 10, 2 * concurrency)
    for _ in range(worker_calls):
        await client.send_messages(queue, [Message(payload) for _ in range(10)])

    async def work(_: int) -> int:
        messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=0)
        for message in messages:
            await client.delete_messages(queue, [message.receipt])
        return len(messages)

    worker = await run_phase("worker", concurrency, worker_calls, pid, work)
    # Per message, not per receive: what a worker loop delivers.
    elapsed = worker["calls"] / worker["calls_per_s"] if worker.get("calls_per_s") else 0
    worker["messages_per_s"] = round(worker["operations"] / elapsed, 1) if elapsed else 0.0
    results.append(worker)
    return results


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
    parser.add_argument("--label", default="default", help="names the output file latency-LABEL.json")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write latency-LABEL.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-latency-"))
    queue = "bench"
    server = dataplane.start_server(root / "data", f"{queue}:shards={args.shards}", None)
    try:
        results = asyncio.run(measure(args, server, queue))
    finally:
        dataplane.stop_process(server.process)
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "latency",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": dataplane.git_revision(),
        "shards": args.shards,
        "payload_bytes": args.payload_bytes,
        "fsync": True,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"latency-{args.label}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
