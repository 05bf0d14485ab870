"""`shardq demo`: a local server, a producer and a consumer, with a live status line.

Everything it starts runs on 127.0.0.1 and is stopped by PID when the demo ends
(after --duration, or on Ctrl-C). One message in twenty makes the handler fail,
so retries with backoff and, after three receives, the dead-letter queue show up.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from shardq.aio import AsyncClient
from shardq.consumer import ConsumerStats, run_consumer
from shardq.durations import parse_duration_ms
from shardq.errors import ShardqError
from shardq.types import ReceivedMessage

QUEUE = "demo"
DLQ = "demo-dlq"
READY_TIMEOUT_S = 30
DEMO_REDRIVE = f"dead_letter_queue={DLQ},max_receive_count=3"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(
    data_dir: pathlib.Path, port: int, metrics_port: int, log_path: pathlib.Path
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "shardq", "serve",
        "--data-dir", str(data_dir), "--port", str(port), "--metrics-port", str(metrics_port),
        "--queue", f"{QUEUE}:shards=4,visibility=5s,{DEMO_REDRIVE},nack_backoff_base=200ms",
        "--queue", DLQ, "--log-format", "text",
    ]  # fmt: skip
    with log_path.open("ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=log_file)


async def _wait_ready(client: AsyncClient, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise click.ClickException(f"the server exited with code {server.returncode}")
        with contextlib.suppress(ShardqError):
            await client.list_queues()
            return
        await asyncio.sleep(0.1)
    raise click.ClickException("the server did not become ready in time")


async def _run_demo(endpoint: str, server: subprocess.Popen[bytes], duration_s: float, rate: float) -> None:
    async with AsyncClient(endpoint) as client:
        await _wait_ready(client, server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        sent = 0
        latencies: list[float] = []

        async def produce() -> None:
            nonlocal sent
            started = time.monotonic()
            while not stop.is_set() and time.monotonic() - started < duration_s:
                body = f"order {sent} at {time.time():.3f}".encode()
                await client.send(QUEUE, body, attributes={"n": str(sent)})
                sent += 1
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            stop.set()

        async def handle(message: ReceivedMessage) -> None:
            if int(message.attributes.get("n", "0")) % 20 == 7:
                raise RuntimeError("simulated handler failure")
            latencies.append(time.time() * 1000 - message.sent_at_ms)

        async def report() -> None:
            while not stop.is_set():
                await asyncio.sleep(1)
                stats = await client.attributes(QUEUE)
                dead = await client.attributes(DLQ)
                recent = sorted(latencies[-500:])
                p50 = recent[len(recent) // 2] if recent else 0.0
                click.echo(
                    f"sent {sent:>6}  handled {consumer_stats.handled:>6}  failed {consumer_stats.failed:>4}  "
                    f"visible {stats.visible:>4}  in-flight {stats.in_flight:>3}  delayed {stats.delayed:>3}  "
                    f"dead-lettered {dead.visible:>3}  end-to-end p50 {p50:6.1f} ms",
                    err=True,
                )

        consumer_stats = ConsumerStats()

        async def consume() -> None:
            await run_consumer(
                client, QUEUE, handle, concurrency=16, stop=stop, handle_signals=False, stats=consumer_stats
            )

        reporter = asyncio.create_task(report())
        await asyncio.gather(produce(), consume())
        reporter.cancel()
        click.echo(f"done: sent {sent}, handled {consumer_stats.handled}, failed attempts {consumer_stats.failed}")


@click.command("demo")
@click.option("--duration", default="60s", show_default=True, help="how long the producer runs")
@click.option("--rate", default=200.0, show_default=True, help="messages per second")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None)
def demo_command(duration: str, rate: float, data_dir: pathlib.Path | None) -> None:
    """Run a local server with a producer and a consumer you can watch."""
    duration_s = parse_duration_ms(duration) / 1000
    # The simulated failures are the point of the demo; their warnings are not.
    logging.getLogger("shardq.consumer").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="shardq-demo-") as scratch:
        directory = data_dir or pathlib.Path(scratch) / "data"
        port, metrics_port = _free_port(), _free_port()
        log_path = pathlib.Path(scratch) / "server.log"
        server = _start_server(directory, port, metrics_port, log_path)
        click.echo(
            f"server pid {server.pid} on 127.0.0.1:{port}; metrics http://127.0.0.1:{metrics_port}/metrics; "
            f"log {log_path}",
            err=True,
        )
        try:
            asyncio.run(_run_demo(f"127.0.0.1:{port}", server, duration_s, rate))
        finally:
            if server.poll() is None:
                os.kill(server.pid, signal.SIGTERM)
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
