"""shardq beside the systems it means to beat, on the same machine, workload and harness.

Each system (`bench/peer_systems/`) runs as a child process on 127.0.0.1 with its data in a
fresh temporary directory and a durable queue: shardq (fsync per answer), Redis Streams
(appendfsync always), Postgres with pgmq's SQL (synchronous commit), NATS JetStream (file
storage) and RabbitMQ quorum queues (publisher confirms). The JSON says, per system, what
an acknowledgement means on disk and where its idiom differs.

For each concurrency C in --concurrency, C callers in this one process (one event loop,
uvloop where installed) each keep exactly one call in flight; every call's latency is
recorded. Phases, in order, for each C:

  send1   send one 256-byte message, awaiting the acknowledgement
  send10  send ten in one call (one request, pipeline or transaction where the system has
          one; concurrent publishes awaited together where it has none)
  worker  C consumers each receive up to 10 (no wait), then delete each message awaiting
          the answer, until the queue is empty: what the send phases stored, topped up to
          --worker-messages beforehand (untimed). A call is one receive and its deletes;
          the receive's and the deletes' own latencies are reported beside it.

Each phase runs --ops calls (at least 4 per caller) or --max-seconds, whichever comes
first. Reported per cell: calls/s and messages/s, p50 / p99 / p99.9 latency, and CPU per
message of the system's server processes (their children included: Postgres's backends)
and of this client process. Whatever a phase left in the queue is drained, untimed, before
the next concurrency.

With --runs N every system is measured N times, the systems interleaved within each run so
that a slow stretch of the machine does not land on one system; each cell reports the run
with its median rate.

Usage: python bench/peers.py [--systems shardq,redis,postgres,nats,rabbitmq]
       [--concurrency 1,4,16] [--ops 3000] [--max-seconds 15] [--runs 1]
       [--worker-messages 5000] [--out bench/results] [--label peers] [--plot]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]
import reports
from peer_systems import PeerQueue, Running

from shardq import event_loops

SYSTEMS = {
    "shardq": "peer_systems.shardq_server",
    "redis": "peer_systems.redis_streams",
    "postgres": "peer_systems.postgres_table",
    "nats": "peer_systems.nats_jetstream",
    "rabbitmq": "peer_systems.rabbitmq_quorum",
}
PHASES = ("send1", "send10", "worker")
PAYLOAD = b"x" * 256
QUEUE = "bench"
# Untimed filling and draining: enough callers to be quick on every system.
HELPERS = 8


def progress(text: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it, found through /proc's children lists."""
    found = [pid]
    for parent in found:  # grows while it is walked
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            found.extend(dataplane.child_pids(parent))
    return found


def servers_cpu_seconds(pids: list[int]) -> float:
    """CPU of the system's processes and their children, as far as they still run (a
    backend that exited takes its CPU with it: the harness keeps its connections open)."""
    total = 0.0
    for root in pids:
        for pid in descendants(root):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += dataplane.process_cpu_seconds(pid)
    return total


async def each_caller(
    handles: list[PeerQueue], calls: int, max_seconds: float, call: Callable[[PeerQueue], Awaitable[int]]
) -> tuple[list[float], int, float]:
    """Every handle's caller with one call in flight until `calls` calls are made (or
    time is up, or a call returns -1: nothing left). Latencies, messages, seconds."""
    latencies: list[float] = []
    remaining = [calls]
    messages = [0]
    finished = [False]
    started = time.perf_counter()
    deadline = started + max_seconds

    async def caller(handle: PeerQueue) -> None:
        while remaining[0] > 0 and not finished[0] and time.perf_counter() < deadline:
            remaining[0] -= 1
            began = time.perf_counter()
            done = await call(handle)
            if done < 0:
                finished[0] = True
                return
            latencies.append(time.perf_counter() - began)
            messages[0] += done

    await asyncio.gather(*(caller(handle) for handle in handles))
    return latencies, messages[0], time.perf_counter() - started


async def drain(handles: list[PeerQueue]) -> int:
    """Untimed: receive and delete until a receive finds nothing; how many went."""

    async def one(handle: PeerQueue) -> int:
        count = 0
        while received := await handle.receive(10):
            for message in received:  # one call in flight per handle, as everywhere here
                await handle.delete(message)
            count += len(received)
        return count

    return sum(await asyncio.gather(*(one(handle) for handle in handles)))


async def fill(handles: list[PeerQueue], messages: int) -> None:
    """Untimed: `messages` more messages in the queue, ten a call."""
    batches = [min(10, messages - start) for start in range(0, messages, 10)]

    async def one(handle: PeerQueue) -> None:
        while batches:
            await handle.send([PAYLOAD] * batches.pop())

    await asyncio.gather(*(one(handle) for handle in handles))


async def measure_system(system: Running, args: argparse.Namespace, run: int) -> list[dict[str, Any]]:
    helpers = [await system.connect() for _ in range(HELPERS)]
    cells: list[dict[str, Any]] = []
    try:
        await drain(helpers)
        for concurrency in args.concurrency:
            handles = [await system.connect() for _ in range(concurrency)]
            try:
                for phase in args.phases:
                    cells.append(await measure_phase(system, args, phase, concurrency, handles, helpers, run))
            finally:
                await asyncio.gather(*(handle.close() for handle in handles))
            left = await drain(helpers)
            if left:
                progress(f"{system.name} C={concurrency}: drained {left} messages left by the phases")
    finally:
        await asyncio.gather(*(handle.close() for handle in helpers))
    return cells


async def measure_phase(
    system: Running,
    args: argparse.Namespace,
    phase: str,
    concurrency: int,
    handles: list[PeerQueue],
    helpers: list[PeerQueue],
    run: int,
) -> dict[str, Any]:
    receives: list[float] = []
    deletes: list[float] = []
    if phase == "worker":
        # Timed from the first receive: what the send phases stored, topped up.
        await fill(helpers, args.worker_messages)

        async def call(handle: PeerQueue) -> int:
            began = time.perf_counter()
            received = await handle.receive(10)
            receives.append(time.perf_counter() - began)
            if not received:
                return -1  # the queue is empty: the phase is over
            for message in received:
                began = time.perf_counter()
                await handle.delete(message)
                deletes.append(time.perf_counter() - began)
            return len(received)

        calls = 1 << 62  # until the queue is empty, or time is up
    else:
        size = 1 if phase == "send1" else 10
        bodies = [PAYLOAD] * size

        async def call(handle: PeerQueue) -> int:
            await handle.send(bodies)
            return size

        calls = max(args.ops, 4 * concurrency)
    client_before = dataplane.own_cpu_seconds()
    server_before = servers_cpu_seconds(system.pids)
    latencies, messages, seconds = await each_caller(handles, calls, args.max_seconds, call)
    server_cpu = servers_cpu_seconds(system.pids) - server_before
    client_cpu = dataplane.own_cpu_seconds() - client_before
    cell: dict[str, Any] = {
        "system": system.name,
        "phase": phase,
        "concurrency": concurrency,
        "run": run,
        **dataplane.latency_summary(latencies),
        "messages": messages,
        "seconds": round(seconds, 3),
        "calls_per_s": round(len(latencies) / seconds, 1) if seconds else 0.0,
        "messages_per_s": round(messages / seconds, 1) if seconds else 0.0,
        "server_cpu_us_per_message": round(server_cpu * 1e6 / messages, 1) if messages else 0.0,
        "client_cpu_us_per_message": round(client_cpu * 1e6 / messages, 1) if messages else 0.0,
    }
    if phase == "worker":
        cell["receive"] = dataplane.latency_summary(receives)
        cell["delete"] = dataplane.latency_summary(deletes)
    progress(
        f"{system.name:<8} C={concurrency:<3} {phase:<6} {cell['messages_per_s']:>9,.0f} msgs/s  "
        f"p50 {cell.get('p50_ms', 0):7.2f} ms  p99 {cell.get('p99_ms', 0):7.2f} ms  "
        f"server {cell['server_cpu_us_per_message']:6.0f} us/msg"
    )
    return cell


def measure(name: str, args: argparse.Namespace, run: int) -> tuple[Running, list[dict[str, Any]]]:
    module = importlib.import_module(SYSTEMS[name])
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"shardq-peers-{name}-"))
    os.chmod(root, 0o755)  # Postgres runs as its own user and must reach its directory
    workdir = root / "system"
    workdir.mkdir()
    try:
        with module.running(workdir, QUEUE) as system:
            progress(f"{name}: {system.version}; {system.durability}")
            cells: list[dict[str, Any]] = event_loops.run(measure_system(system, args, run), choice=event_loops.AUTO)
            return system, cells
    finally:
        shutil.rmtree(root, ignore_errors=True)


def median_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, phase, concurrency), the run with the median rate, every run's rate beside it."""
    chosen = []
    keys = sorted({(c["system"], c["phase"], c["concurrency"]) for c in cells}, key=str)
    for key in keys:
        runs = sorted((c for c in cells if (c["system"], c["phase"], c["concurrency"]) == key), key=_rate)
        cell = dict(runs[(len(runs) - 1) // 2])
        cell["messages_per_s_runs"] = [_rate(run) for run in runs]
        chosen.append(cell)
    return chosen


def _rate(cell: dict[str, Any]) -> float:
    rate: float = cell["messages_per_s"]
    return rate


def plot(path: pathlib.Path, cells: list[dict[str, Any]], systems: list[str]) -> None:
    """Per phase: messages per second (bars) and p50 per call, by system and concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({cell["concurrency"] for cell in cells})
    phases = [phase for phase in PHASES if any(cell["phase"] == phase for cell in cells)]
    figure, axes = plt.subplots(len(phases), 2, figsize=(13, 3.6 * len(phases)), squeeze=False)
    width = 0.8 / max(len(systems), 1)
    for (rate_axis, latency_axis), phase in zip(axes, phases, strict=True):
        for offset, system in enumerate(systems):
            by_concurrency = {
                cell["concurrency"]: cell for cell in cells if cell["phase"] == phase and cell["system"] == system
            }
            xs = [i + offset * width for i in range(len(concurrencies))]
            rate_axis.bar(
                xs, [by_concurrency.get(c, {}).get("messages_per_s", 0) for c in concurrencies], width, label=system
            )
            latency_axis.bar(
                xs, [by_concurrency.get(c, {}).get("p50_ms", 0) for c in concurrencies], width, label=system
            )
        for axis, label in ((rate_axis, "messages/s"), (latency_axis, "p50 ms a call")):
            axis.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(concurrencies))])
            axis.set_xticklabels([f"{c} in flight" for c in concurrencies])
            axis.set_title(f"{phase}: {label}")
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(cells: list[dict[str, Any]]) -> None:
    for cell in cells:
        print(
            f"{cell['system']:<9} {cell['phase']:<7} C={cell['concurrency']:<3} "
            f"{cell['messages_per_s']:>10,.0f} msgs/s  p50 {cell.get('p50_ms', 0):7.2f} ms  "
            f"p99 {cell.get('p99_ms', 0):7.2f} ms  server {cell['server_cpu_us_per_message']:6.0f} us/msg",
            file=sys.stderr,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from: " + ", ".join(SYSTEMS))
    parser.add_argument("--concurrency", default="1,4,16", help="calls in flight, comma-separated")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--ops", type=int, default=3000, help="calls per send phase")
    parser.add_argument("--max-seconds", type=float, default=15.0, help="bound on each phase")
    parser.add_argument("--worker-messages", type=int, default=5000, help="messages added before each worker phase")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--label", default="peers")
    parser.add_argument("--plot", action="store_true", help="a PNG beside the JSON (needs --out)")
    args = parser.parse_args(argv)
    args.systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.phases = [phase.strip() for phase in args.phases.split(",")]
    if unknown_phases := sorted(set(args.phases) - set(PHASES)):
        parser.error(f"unknown phases {unknown_phases}; known: {', '.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    described: dict[str, dict[str, str]] = {}
    cells: list[dict[str, Any]] = []
    loads = []
    for run in range(args.runs):
        # Interleaved, and each run in another order: drift does not favour one system.
        order = args.systems[run % len(args.systems) :] + args.systems[: run % len(args.systems)]
        for name in order:
            progress(f"run {run + 1}/{args.runs}: {name}")
            load_before = os.getloadavg()[0]
            system, measured = measure(name, args, run)
            loads.append({"system": name, "run": run, "load_before": round(load_before, 2)})
            described[name] = {"version": system.version, "durability": system.durability, "notes": system.notes}
            cells.extend(measured)
    chosen = median_cells(cells)
    print_table(chosen)
    report = {
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "setup": {
            "cpus": os.cpu_count(),
            "payload_bytes": len(PAYLOAD),
            "ops": args.ops,
            "max_seconds": args.max_seconds,
            "worker_messages": args.worker_messages,
            "runs": args.runs,
            "client_loop": event_loops.resolve(event_loops.AUTO),
            "loads": loads,
        },
        "systems": described,
        "results": chosen,
        "every_run": cells,
    }
    reports.emit(report, args.out, f"peers-{args.label}.json")
    if args.plot and args.out is not None:
        plot(args.out / f"peers-{args.label}.png", chosen, args.systems)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
