"""Where one durable send's time goes: timestamps along a send over the producer stream.

One `shardq serve` (a 4-shard queue, fsync on) runs in a child process of this script
with timestamps added around its request decoding, the send's handler, the batch's
commit and the response encoding; this process's AsyncClient adds its own around
`send()`, the request handed to gRPC, its encoding and the response's decoding. Both
sides read CLOCK_MONOTONIC (`time.perf_counter`), so their stamps compare directly. One
call is in flight at a time; the report gives each segment's p50 in µs over --sends
sends (after 200 unstamped ones).

--no-sync opens the server's LMDB environments with sync and metasync off, for this
measurement only (shardq has no such setting): what the send costs without its syncs.

Usage: python bench/send_timeline.py [--sends 3000] [--no-sync] [--out bench/results --label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]

SERVER_STAMPS = (
    "decoded",
    "handler_started",
    "commit_started",
    "written_ahead",
    "commit_ended",
    "handler_ended",
    "encoded",
)
WARM_UP_SENDS = 200


def open_lmdb_without_syncs() -> None:
    """From now on, this process opens LMDB environments with sync and metasync off."""
    import lmdb

    open_environment = lmdb.open

    def open_without_syncs(*args: Any, **kwargs: Any) -> Any:
        return open_environment(*args, **{**kwargs, "sync": False, "metasync": False})

    lmdb.open = open_without_syncs


def codec_stamper(stamps: dict[str, list[float]]) -> Callable[[str, Any], Any]:
    """Wraps a gRPC handler's codec so that each call stamps `stamps[name]` first."""
    clock = time.perf_counter
    # The interceptors wrap a handler's codec again (a decoder around the stamped one): the
    # outermost call stamps, the ones inside it do not.
    inside: set[str] = set()

    def stamping(name: str, codec: Any) -> Any:
        def stamped(value: Any) -> Any:
            if name in inside:
                return codec(value)
            inside.add(name)
            try:
                stamps[name].append(clock())
                return codec(value)
            finally:
                inside.discard(name)

        return stamped

    return stamping


def prepare_stamped_server(stamps: dict[str, list[float]], handler_builder: str, *, no_sync: bool) -> None:
    """A stamped server process's set-up, before anything else imports gRPC: gRPC's I/O as
    the shardq command has it, LMDB without syncs if asked, and the codecs of every
    handler `grpc.<handler_builder>` builds (e.g. "unary_unary_rpc_method_handler")
    stamping `decoded` and `encoded`."""
    from shardq.grpc_io import use_completion_queue_polling

    use_completion_queue_polling()  # as the shardq command does

    import grpc

    if no_sync:
        open_lmdb_without_syncs()
    build_handler = getattr(grpc, handler_builder)
    stamping = codec_stamper(stamps)

    def stamped_handler(behavior: Any, request_deserializer: Any = None, response_serializer: Any = None) -> Any:
        return build_handler(
            behavior,
            request_deserializer=None if request_deserializer is None else stamping("decoded", request_deserializer),
            response_serializer=None if response_serializer is None else stamping("encoded", response_serializer),
        )

    setattr(grpc, handler_builder, stamped_handler)


def stamp_batches(stamps: dict[str, list[float]], *, begun: str, committed: str) -> None:
    """Every shard's batches stamp `begun` as their transaction starts (GroupCommitter._begin)
    and `committed` once LMDB's commit returns (GroupCommitter._complete)."""
    from shard_server.runtime import committing

    clock = time.perf_counter
    begin = committing.GroupCommitter._begin
    complete = committing.GroupCommitter._complete

    def stamped_begin(self: Any, loop: Any, batch: Any, **options: Any) -> Any:
        stamps[begun].append(clock())
        return begin(self, loop, batch, **options)

    def stamped_complete(self: Any, started: Any) -> Any:
        try:
            return complete(self, started)
        finally:
            stamps[committed].append(clock())

    committing.GroupCommitter._begin = stamped_begin  # type: ignore[method-assign]
    committing.GroupCommitter._complete = stamped_complete  # type: ignore[method-assign]


def run_stamped_server(stamps: dict[str, list[float]], out: pathlib.Path, argv: list[str]) -> None:
    """`shardq serve` (`argv`) in this process; `stamps` written to `out` when it stops."""
    from shardq.cli import main as run_command

    sys.argv = ["shardq", *argv]
    try:
        run_command()
    finally:
        out.write_text(json.dumps(stamps))


def serve_with_stamps(out: pathlib.Path, no_sync: bool, argv: list[str]) -> None:
    """The server's side: `shardq serve` with stamps, written to `out` when it stops."""
    stamps: dict[str, list[float]] = {name: [] for name in SERVER_STAMPS}
    prepare_stamped_server(stamps, "stream_stream_rpc_method_handler", no_sync=no_sync)
    clock = time.perf_counter

    from shard_server.service import queues

    send = queues.QueueServicer._send

    async def stamped_send(self: Any, request: Any, *, forwarded: bool = False) -> Any:
        stamps["handler_started"].append(clock())
        try:
            return await send(self, request, forwarded=forwarded)
        finally:
            stamps["handler_ended"].append(clock())

    queues.QueueServicer._send = stamped_send  # type: ignore[method-assign]
    stamp_batches(stamps, begun="commit_started", committed="commit_ended")

    from shard_server.storage.commit_ahead import CommitAheadFile

    write_ahead = CommitAheadFile.write

    def stamped_write_ahead(self: Any, entry: bytes, **where: Any) -> None:
        write_ahead(self, entry, **where)
        stamps["written_ahead"].append(clock())

    CommitAheadFile.write = stamped_write_ahead  # type: ignore[method-assign]
    run_stamped_server(stamps, out, argv)


def stamp_client_codecs(stamps: dict[str, list[float]], method: str, kind: str, response: Any) -> None:
    """QueueService stubs made from now on stamp `encoded` and `decoded` around `method`'s
    codecs (`kind`: the channel's method builder, e.g. "unary_unary"; `response`: the
    method's response message class)."""
    from shardq.api.v1 import queue_pb2_grpc

    clock = time.perf_counter
    make_stub = queue_pb2_grpc.QueueServiceStub.__init__

    def stamped_stub(self: Any, channel: Any) -> None:
        make_stub(self, channel)

        def encode(message: Any) -> bytes:
            stamps["encoded"].append(clock())
            return bytes(message.SerializeToString())

        def decode(data: bytes) -> Any:
            stamps["decoded"].append(clock())
            return response.FromString(data)

        build = getattr(channel, kind)
        setattr(
            self,
            method,
            build(f"/shardq.v1.QueueService/{method}", request_serializer=encode, response_deserializer=decode),
        )

    queue_pb2_grpc.QueueServiceStub.__init__ = stamped_stub  # type: ignore[method-assign]


async def send_with_stamps(endpoint: str, sends: int) -> dict[str, list[float]]:
    """The client's side: `sends` single sends over the producer stream, one at a time."""
    from shardq import aio
    from shardq.api.v1 import queue_pb2

    stamps: dict[str, list[float]] = {"called": [], "handed_to_grpc": [], "encoded": [], "decoded": [], "returned": []}
    clock = time.perf_counter
    iterate = aio.ProducerStream._request_iterator

    async def stamped_iterator(self: Any) -> Any:
        async for request in iterate(self):
            stamps["handed_to_grpc"].append(clock())
            yield request

    aio.ProducerStream._request_iterator = stamped_iterator  # type: ignore[method-assign]
    stamp_client_codecs(stamps, "SendStream", "stream_stream", queue_pb2.SendStreamResponse)
    async with aio.AsyncClient(endpoint) as client:
        for _ in range(WARM_UP_SENDS):
            await client.send("bench", b"x" * 256)
        for _ in range(sends):
            stamps["called"].append(clock())
            await client.send("bench", b"x" * 256)
            stamps["returned"].append(clock())
    return stamps


def segments(client: dict[str, list[float]], server: dict[str, list[float]], sends: int) -> dict[str, float]:
    def last(stamps: list[float]) -> list[float]:
        return stamps[-sends:]

    c = {name: last(values) for name, values in client.items()}
    s = {name: last(values) for name, values in server.items()}
    if len(s["written_ahead"]) == sends:
        # Answered once the entry was written ahead; LMDB's commit runs after the answer.
        commit_steps = [
            ("server: LMDB work and the commit-ahead write", s["commit_started"], s["written_ahead"]),
            ("server: written ahead to the handler's answer", s["written_ahead"], s["handler_ended"]),
            ("server: LMDB's commit after the write ahead (not waited for)", s["written_ahead"], s["commit_ended"]),
        ]
    else:
        commit_steps = [
            ("server: commit (the send's LMDB work and syncs)", s["commit_started"], s["commit_ended"]),
            ("server: commit to the handler's answer", s["commit_ended"], s["handler_ended"]),
        ]
    steps = [
        ("client: send() to the request handed to gRPC", c["called"], c["handed_to_grpc"]),
        ("client: handed to gRPC to encoded", c["handed_to_grpc"], c["encoded"]),
        ("gRPC, client to server: encoded to decoded", c["encoded"], s["decoded"]),
        ("server: decoded to the send's handler", s["decoded"], s["handler_started"]),
        ("server: handler to its batch's commit", s["handler_started"], s["commit_started"]),
        *commit_steps,
        ("server: answer to the response encoded", s["handler_ended"], s["encoded"]),
        ("gRPC, server to client: encoded to decoded", s["encoded"], c["decoded"]),
        ("client: decoded to send() returning", c["decoded"], c["returned"]),
        ("whole send", c["called"], c["returned"]),
    ]
    return {
        name: round(statistics.median((end - start) * 1e6 for start, end in zip(starts, ends, strict=True)), 1)
        for name, starts, ends in steps
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sends", type=int, default=3_000)
    parser.add_argument("--no-sync", action="store_true", help="server LMDB without syncs (this measurement only)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="passed to `shardq serve` (--server-arg=--no-commit-ahead)"
    )
    parser.add_argument("--label", default="default")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write send-timeline-LABEL.json")
    parser.add_argument("--serve-with-stamps", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.serve_with_stamps is not None:
        serve_with_stamps(args.serve_with_stamps, args.no_sync, rest)
        return 0

    # Imported here, not at the top: the server's side above has no use for the
    # benchmark client (dataplane also asks for gRPC's completion-queue I/O, as the
    # shardq command does, before it imports gRPC).
    import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]

    from shardq import event_loops

    root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-timeline-"))
    stamps_file = root / "server-stamps.json"
    launcher = (__file__, "--serve-with-stamps", str(stamps_file), *(["--no-sync"] if args.no_sync else []))
    server = dataplane.start_server(root / "data", "bench:shards=4", None, tuple(args.server_arg), launcher=launcher)
    try:
        print(f"[send-timeline] {args.sends} sends to {server.endpoint} ...", file=sys.stderr, flush=True)
        client = event_loops.run(send_with_stamps(server.endpoint, args.sends))
    finally:
        dataplane.stop_process(server.process)
    server_stamps = json.loads(stamps_file.read_text())
    shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "send-timeline",
        "sends": args.sends,
        "server_syncs": not args.no_sync,
        "server_args": args.server_arg,
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        # Batches whose answer went out once their entry was written ahead (commit_ahead).
        "written_ahead": len(server_stamps["written_ahead"]),
        "commits": len(server_stamps["commit_ended"]),
        "p50_us": segments(client, server_stamps, args.sends),
    }
    reports.emit(report, args.out, f"send-timeline-{args.label}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
