"""Where a receive's time goes, for one caller and for four: timestamps along its request.

For each number of callers in --callers (a fresh server each), one `shardq serve` (a
4-shard queue, fsync on) runs in a child process of this script with timestamps added
along a receive; this process's AsyncClient adds its own. Each caller keeps one
`receive_messages(max 10, no wait)` in flight, as `bench/latency.py`'s receive.unary
does, so four callers' receives share one request (a shared receive of four shares)
where one caller's is a request of its own. Both sides read CLOCK_MONOTONIC
(`time.perf_counter`), so their stamps compare directly. Per request, the p50 in µs of:

  client: request started to encoded       the client's request built and encoded
  gRPC, client to server                   encoded to decoded in the server
  server: decoded to claims queued         the handler, validation, the shard chosen
  server: claims queued to batch begun     the hand-off to the writer thread, and any
                                           wait behind the shard's previous batch
  server: batch begun to claims answered   the claims, and their answer's hand-back to
                                           the event loop (a receive answers before
                                           its batch's LMDB commit)
  server: claims answered to encoded       the response built and encoded
  gRPC, server to client                   encoded to decoded in the client
  client: decoded to request ended         the messages converted and split by share
  client: request ended to next started    the callers woken, and their next calls
                                           folded into the next request

and, beside them: the callers' receive p50 (a call to its return), the round (one
request's start to the next one's), how many messages a request claimed, LMDB's commit
after the answer (not waited for by this request), and how often a request reached the
server while the shard's previous batch was still committing.

--no-sync opens the server's LMDB environments with sync and metasync off, for this
measurement only (shardq has no such setting).

Usage: python bench/receive_timeline.py [--callers 1,4] [--rounds 2000] [--no-sync]
       [--out bench/results --label NAME]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]
from send_timeline import (  # bench/send_timeline.py
    prepare_stamped_server,
    run_stamped_server,
    stamp_batches,
    stamp_client_codecs,
)

QUEUE = "bench"
MAX_MESSAGES = 10
PAYLOAD_BYTES = 256
WARM_UP_ROUNDS = 200
SERVER_STAMPS = (
    "decoded",
    "handler_started",
    "claims_queued",
    "claims_answered",
    "batch_begun",
    "commit_ended",
    "handler_ended",
    "encoded",
)
CLIENT_STAMPS = ("started", "encoded", "decoded", "ended")


def serve_with_stamps(out: pathlib.Path, no_sync: bool, argv: list[str]) -> None:
    """The server's side: `shardq serve` with stamps, written to `out` when it stops."""
    stamps: dict[str, list[float]] = {name: [] for name in SERVER_STAMPS}
    # Every unary method's codecs stamp; which stamps are a receive's is decided by its
    # handler's stamps (the last decode before it, the first encode after it).
    prepare_stamped_server(stamps, "unary_unary_rpc_method_handler", no_sync=no_sync)
    clock = time.perf_counter

    from shard_server.runtime import hosting
    from shard_server.service import queues

    receive = queues.QueueServicer.ReceiveMessages

    async def stamped_receive(self: Any, request: Any, context: Any) -> Any:
        stamps["handler_started"].append(clock())
        try:
            return await receive(self, request, context)
        finally:
            stamps["handler_ended"].append(clock())

    queues.QueueServicer.ReceiveMessages = stamped_receive  # type: ignore[method-assign]
    claim_now = hosting.HostedQueue._claim_now

    async def stamped_claim_now(self: Any, *args: Any, **kwargs: Any) -> Any:
        stamps["claims_queued"].append(clock())
        try:
            return await claim_now(self, *args, **kwargs)
        finally:
            stamps["claims_answered"].append(clock())

    hosting.HostedQueue._claim_now = stamped_claim_now  # type: ignore[method-assign]
    stamp_batches(stamps, begun="batch_begun", committed="commit_ended")
    run_stamped_server(stamps, out, argv)


async def receive_with_stamps(endpoint: str, callers: int, rounds: int) -> dict[str, Any]:
    """The client's side: `callers` callers, each receiving with one call in flight, for
    WARM_UP_ROUNDS + `rounds` calls each, on a queue filled for them beforehand."""
    import latency  # bench/latency.py: only the client's side needs it (and gRPC's set-up)

    from shardq import aio
    from shardq.api.v1 import queue_pb2

    stamps: dict[str, list[float]] = {name: [] for name in CLIENT_STAMPS}
    claimed: list[int] = []
    clock = time.perf_counter
    receive_now = aio.AsyncClient._receive_now

    async def stamped_receive_now(self: Any, *args: Any, **kwargs: Any) -> Any:
        stamps["started"].append(clock())
        try:
            parts = await receive_now(self, *args, **kwargs)
            claimed.append(sum(len(part) for part in parts))
            return parts
        finally:
            stamps["ended"].append(clock())

    stamp_client_codecs(stamps, "ReceiveMessages", "unary_unary", queue_pb2.ReceiveMessagesResponse)
    calls = callers * (WARM_UP_ROUNDS + rounds)
    async with aio.AsyncClient(endpoint) as client:
        await latency.fill(client, QUEUE, b"x" * PAYLOAD_BYTES, MAX_MESSAGES * calls)
        print(f"[receive-timeline] {callers} callers, {calls} receives ...", file=sys.stderr, flush=True)
        aio.AsyncClient._receive_now = stamped_receive_now  # type: ignore[method-assign]
        try:

            async def receive(_: int) -> int:
                return len(await client.receive_messages(QUEUE, max_messages=MAX_MESSAGES, wait_time_ms=0))

            took, _ = await latency.callers(callers, calls, float(calls), receive)
        finally:
            aio.AsyncClient._receive_now = receive_now  # type: ignore[method-assign]
    return {"stamps": stamps, "claimed": claimed, "latencies": took[callers * WARM_UP_ROUNDS :]}


def p50_us(pairs: list[tuple[float, float]]) -> float:
    return round(statistics.median((end - start) * 1e6 for start, end in pairs), 1)


def first_at_or_after(stamps: list[float], moment: float) -> float:
    return stamps[bisect.bisect_left(stamps, moment)]


def last_at_or_before(stamps: list[float], moment: float) -> float:
    return stamps[bisect.bisect_right(stamps, moment) - 1]


def segments(client: dict[str, Any], server: dict[str, list[float]], skip: int) -> dict[str, Any]:
    """Each request's segments (the first `skip` requests left out: the warm-up), paired
    by order: the client's requests and the server's receive handlers, one to one."""
    c = client["stamps"]
    requests = len(c["started"])
    if not (len(c["encoded"]) == len(c["decoded"]) == len(c["ended"]) == requests == len(server["handler_started"])):
        raise SystemExit(
            f"stamps do not pair: the client made {requests} requests and the server handled "
            f"{len(server['handler_started'])} receives"
        )
    s = {name: sorted(values) for name, values in server.items()}
    rows = []
    for number in range(skip, requests - 1):
        handler_started = server["handler_started"][number]
        handler_ended = server["handler_ended"][number]
        queued = first_at_or_after(s["claims_queued"], handler_started)
        answered = first_at_or_after(s["claims_answered"], queued)
        begun = first_at_or_after(s["batch_begun"], queued)
        previous_commit = last_at_or_before(s["commit_ended"], begun)
        rows.append(
            {
                "started": c["started"][number],
                "encoded": c["encoded"][number],
                "server_decoded": last_at_or_before(s["decoded"], handler_started),
                "queued": queued,
                "begun": begun,
                "answered": answered,
                "commit_ended": first_at_or_after(s["commit_ended"], begun),
                "server_encoded": first_at_or_after(s["encoded"], handler_ended),
                "decoded": c["decoded"][number],
                "ended": c["ended"][number],
                "next_started": c["started"][number + 1],
                "waited_for_commit": previous_commit > queued,
            }
        )

    def spans(start: str, end: str) -> list[tuple[float, float]]:
        return [(row[start], row[end]) for row in rows]

    return {
        "requests": len(rows),
        "messages_per_request_p50": statistics.median(client["claimed"][skip:]),
        "callers_receive_p50_us": round(statistics.median(client["latencies"]) * 1e6, 1),
        "round_p50_us": p50_us(spans("started", "next_started")),
        "p50_us": {
            "client: request started to encoded": p50_us(spans("started", "encoded")),
            "gRPC, client to server": p50_us(spans("encoded", "server_decoded")),
            "server: decoded to claims queued": p50_us(spans("server_decoded", "queued")),
            "server: claims queued to batch begun": p50_us(spans("queued", "begun")),
            "server: batch begun to claims answered": p50_us(spans("begun", "answered")),
            "server: claims answered to encoded": p50_us(spans("answered", "server_encoded")),
            "gRPC, server to client": p50_us(spans("server_encoded", "decoded")),
            "client: decoded to request ended": p50_us(spans("decoded", "ended")),
            "client: request ended to next started": p50_us(spans("ended", "next_started")),
            "whole request": p50_us(spans("started", "ended")),
            "LMDB's commit after the answer (not waited for)": p50_us(spans("answered", "commit_ended")),
        },
        "requests_that_waited_for_the_previous_commit": sum(row["waited_for_commit"] for row in rows),
        # Requests started before the one before them ended: their stamps may pair wrongly.
        "requests_overlapping": sum(row["next_started"] < row["ended"] for row in rows),
    }


def measure(callers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One caller count on a fresh server: its segments."""
    import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]

    from shardq import event_loops

    root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-receive-timeline-"))
    stamps_file = root / "server-stamps.json"
    launcher = (__file__, "--serve-with-stamps", str(stamps_file), *(["--no-sync"] if args.no_sync else []))
    try:
        server = dataplane.start_server(
            root / "data", f"{QUEUE}:shards=4", None, tuple(args.server_arg), launcher=launcher
        )
        try:
            client = event_loops.run(receive_with_stamps(server.endpoint, callers, args.rounds))
        finally:
            dataplane.stop_process(server.process)
        server_stamps = json.loads(stamps_file.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    warm_up_requests = len(client["stamps"]["started"]) * WARM_UP_ROUNDS // (WARM_UP_ROUNDS + args.rounds)
    return {"callers": callers, **segments(client, server_stamps, warm_up_requests)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", default="1,4", help="comma-separated caller counts, one fresh server each")
    parser.add_argument("--rounds", type=int, default=2_000, help="receives per caller, after the warm-up")
    parser.add_argument("--no-sync", action="store_true", help="server LMDB without syncs (this measurement only)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to `shardq serve`")
    parser.add_argument("--label", default="default")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write receive-timeline-LABEL.json")
    parser.add_argument("--serve-with-stamps", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.serve_with_stamps is not None:
        serve_with_stamps(args.serve_with_stamps, args.no_sync, rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    caller_counts = [int(part) for part in args.callers.split(",")]
    if not caller_counts or min(caller_counts) < 1 or args.rounds < 10:
        parser.error("--callers must be positive counts and --rounds at least 10")

    loads = [round(os.getloadavg()[0], 2)]
    results = [measure(callers, args) for callers in caller_counts]
    loads.append(round(os.getloadavg()[0], 2))
    report = {
        "benchmark": "receive-timeline",
        "rounds": args.rounds,
        "max_messages": MAX_MESSAGES,
        "payload_bytes": PAYLOAD_BYTES,
        "server_syncs": not args.no_sync,
        "server_args": args.server_arg,
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
        "load_average_before_after": loads,
        "results": results,
    }
    reports.emit(report, args.out, f"receive-timeline-{args.label}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
