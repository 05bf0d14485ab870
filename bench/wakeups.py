"""What waking idle CPUs costs one gRPC call on this machine, below shardq.

With one call in flight, the CPUs sit idle between a request and its answer, and on a
virtual machine whose idle CPUs halt (a Firecracker guest with halt polling off, as
this project's benchmark machine) every wake-up goes through the hypervisor. This
measures a bare grpc.aio echo (uvloop at both ends, one call in flight, 300-byte
messages, the server in a child process) in four configurations, run in turn
--rounds times, each on a fresh server and client:

  default-io         gRPC's default I/O (EventEngine threads)
  default-io.spin    the same, with idle-polling spinners (shard_server/runtime/
                     idle_polling.py, as `shardq serve --idle-poll` starts them) on every
                     CPU, kept spinning by each call
  cq-io              socket I/O on the completion-queue thread (shardq/grpc_io.py: what
                     shardq's servers and command line use)
  cq-io.spin         the same, with the spinners

Per configuration: p50 / p90 / p99 in µs (the round with the median p50, every round's
p50 beside it) and the CPU per call of the server, the client and the spinners.

Usage: python bench/wakeups.py [--calls 3000] [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]

CONFIGURATIONS = ("default-io", "default-io.spin", "cq-io", "cq-io.spin")
COMPLETION_QUEUE_POLLING = "-event_engine_client,-event_engine_listener"
BODY = b"x" * 300
WARM_UP_CALLS = 300
SERVICE = "bench.Echo"


def halt_polling() -> str:
    """The guest's halt polling setting, where the kernel has it (0: idle CPUs halt at once)."""
    parameter = pathlib.Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return f"guest_halt_poll_ns={parameter.read_text().strip()}" if parameter.exists() else "unknown"


def run_server() -> None:
    """Child: an echo server on a free port; prints the port, serves until killed."""
    import grpc
    import uvloop

    async def echo(request: bytes, context: object) -> bytes:
        return request

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    uvloop.run(serve())


def run_client(calls: int, spin: bool) -> dict[str, Any]:
    """Child: starts the server, times `calls` echoes, returns the figures."""
    import grpc
    import uvloop
    from commit_cost import percentiles
    from dataplane import process_cpu_seconds as cpu_seconds

    from shard_server.runtime.idle_polling import IdlePolling, cpus_to_spin_on

    server = subprocess.Popen(
        [sys.executable, __file__, "--role", "server"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    polling = IdlePolling(1000, cpus_to_spin_on(None)) if spin else None
    if polling is not None:
        polling.start()
    keep_awake = polling.called if polling is not None else None

    async def measure() -> tuple[list[float], float, float, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(f"/{SERVICE}/Echo")
            for _ in range(WARM_UP_CALLS):
                await echo(BODY)
            took = []
            spinners = polling.spinner_pids if polling is not None else []
            server_cpu = cpu_seconds(server.pid)
            spinner_cpu = sum(cpu_seconds(pid) for pid in spinners)
            own_cpu = time.process_time()
            for _ in range(calls):
                if keep_awake is not None:
                    keep_awake(0)
                started = time.perf_counter()
                await echo(BODY)
                took.append(time.perf_counter() - started)
            return (
                took,
                cpu_seconds(server.pid) - server_cpu,
                time.process_time() - own_cpu,
                sum(cpu_seconds(pid) for pid in spinners) - spinner_cpu,
            )

    try:
        took, server_cpu, client_cpu, spinner_cpu = uvloop.run(measure())
    finally:
        if polling is not None:
            polling.close()
        server.kill()
        server.wait()
    return {
        **percentiles(took),  # p50_us, p90_us, p99_us as bench/commit_cost.py reports them
        "calls": calls,
        "server_cpu_us_per_call": round(server_cpu / calls * 1e6, 1),
        "client_cpu_us_per_call": round(client_cpu / calls * 1e6, 1),
        "spinner_cpu_us_per_call": round(spinner_cpu / calls * 1e6, 1),
    }


def measure(configuration: str, calls: int) -> dict[str, Any]:
    """One round of one configuration, in a fresh client process (gRPC reads its
    experiments once, at import)."""
    io, _, spin = configuration.partition(".")
    environment = dict(os.environ, GRPC_EXPERIMENTS=COMPLETION_QUEUE_POLLING if io == "cq-io" else "")
    repository = str(pathlib.Path(__file__).resolve().parent.parent)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [repository, environment.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--role", "client", "--calls", str(calls)]
    if spin:
        command.append("--spin")
    output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(output.stdout)
    return result


def plot(path: pathlib.Path, results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    names = list(results)
    axis.bar(range(len(names)), [results[name]["p50_us"] for name in names], color="#88a", label="p50 (median round)")
    for position, name in enumerate(names):
        rounds = results[name]["p50_us_each_round"]
        axis.scatter([position] * len(rounds), rounds, color="black", s=12, zorder=3)
    axis.scatter(range(len(names)), [results[name]["p99_us"] for name in names], color="#c33", marker="x", label="p99")
    axis.set_xticks(range(len(names)), names)
    axis.set_ylabel("µs per bare gRPC call, one in flight")
    axis.set_title("What waking idle CPUs costs a call (dots: each round's p50)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write wakeups.json and .png")
    parser.add_argument("--role", choices=("main", "client", "server"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server":
        run_server()
        return 0
    if args.role == "client":
        print(json.dumps(run_client(args.calls, args.spin)))
        return 0
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
    for number in range(1, args.rounds + 1):
        for name in CONFIGURATIONS:
            result = measure(name, args.calls)
            rounds[name].append(result)
            print(
                f"[wakeups] round {number} {name:<16} p50 {result['p50_us']:7.1f} µs  p99 {result['p99_us']:7.1f} µs  "
                f"cpu/call server {result['server_cpu_us_per_call']:.0f} client {result['client_cpu_us_per_call']:.0f} "
                f"spinners {result['spinner_cpu_us_per_call']:.0f} µs",
                file=sys.stderr,
                flush=True,
            )
    results: dict[str, dict[str, Any]] = {}
    for name, each in rounds.items():
        median = sorted(each, key=lambda result: result["p50_us"])[len(each) // 2]
        results[name] = {**median, "p50_us_each_round": [result["p50_us"] for result in each]}
        print(f"[wakeups] {name:<16} p50 {median['p50_us']:7.1f} µs (median round)", file=sys.stderr)
    report = {
        "benchmark": "wakeups",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "guest_halt_poll": halt_polling(),
        "order": "each round runs every configuration in turn, each on a fresh server and client",
        "results": results,
    }
    reports.emit(report, args.out, "wakeups.json")
    if args.out is not None:
        plot(args.out / "wakeups.png", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
