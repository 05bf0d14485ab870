"""One side of an in-cluster producer/consumer pair: the program bench/in_cluster_throughput.py
runs in a pod (mounted from a ConfigMap), with the image's shardq client.

- producer: `--in-flight` single-message sends over the producer stream (`AsyncClient.send`),
  256-byte bodies, for `--seconds`; each send's latency is recorded.
- consumer: `--in-flight` loops, each receiving up to 10 and deleting them in one call, until
  `--seconds` have passed and then until it has received `--expect` messages, if given
  (or the queue stays empty for 3 s).

Prints one JSON line at the end: counts, the active interval, latency percentiles (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from shardq import AsyncClient, event_loops

BODY_BYTES = 256


def percentiles(samples: list[float]) -> dict[str, float]:
    if len(samples) < 2:
        return {}
    cuts = statistics.quantiles(samples, n=1000, method="inclusive")
    return {"p50_ms": round(cuts[499], 3), "p99_ms": round(cuts[989], 3), "p999_ms": round(cuts[998], 3)}


async def produce(client: AsyncClient, queue: str, *, seconds: float, in_flight: int) -> dict[str, object]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    body = os.urandom(BODY_BYTES // 2).hex().encode()

    async def sender() -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                await client.send(queue, body)
            except Exception:  # counted: a pair that loses sends says so in its result
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.monotonic()
    await asyncio.gather(*(sender() for _ in range(in_flight)))
    elapsed = time.monotonic() - started
    return {
        "role": "producer",
        "sent": len(latencies),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "per_second": round(len(latencies) / elapsed, 1),
        "send_latency": percentiles(latencies),
    }


async def consume(client: AsyncClient, queue: str, *, seconds: float, in_flight: int, expect: int) -> dict[str, object]:
    latencies: list[float] = []
    received = deleted = 0
    started = time.monotonic()
    deadline = started + seconds
    last_seen = started

    def done() -> bool:
        now = time.monotonic()
        if now < deadline:
            return False
        return received >= expect if expect else now - last_seen > 3.0

    async def loop() -> None:
        nonlocal received, deleted, last_seen
        while not done():
            begun = time.perf_counter()
            messages = await client.receive_messages(queue, max_messages=10, wait_time_ms=500)
            if not messages:
                continue
            last_seen = time.monotonic()
            received += len(messages)
            results = await client.delete_messages(queue, [m.receipt for m in messages])
            deleted += sum(1 for r in results if r.ok)
            latencies.append((time.perf_counter() - begun) * 1000)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    elapsed = last_seen - started
    return {
        "role": "consumer",
        "received": received,
        "deleted": deleted,
        "seconds": round(elapsed, 3),
        "per_second": round(deleted / elapsed, 1) if elapsed > 0 else 0.0,
        "receive_and_delete_latency": percentiles(latencies),
    }


async def main_async(arguments: argparse.Namespace) -> dict[str, object]:
    async with AsyncClient(arguments.endpoint) as client:
        if arguments.role == "producer":
            return await produce(client, arguments.queue, seconds=arguments.seconds, in_flight=arguments.in_flight)
        return await consume(
            client, arguments.queue, seconds=arguments.seconds, in_flight=arguments.in_flight, expect=arguments.expect
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("producer", "consumer"), required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--expect", type=int, default=0, help="consumer: messages to receive before stopping")
    arguments = parser.parse_args()
    result = event_loops.run(main_async(arguments), choice=event_loops.from_environment())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
