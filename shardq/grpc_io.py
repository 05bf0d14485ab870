"""Which of gRPC's I/O engines shardq's own processes use: socket I/O on the thread that
polls the completion queue, not on the EventEngine's threads.

Since gRPC 1.6x its core does socket I/O on EventEngine threads and hands each finished
read or write to the thread polling the completion queue, which in grpc.aio then wakes
the event loop: three threads take part in every message, each way. With the
EventEngine's TCP client and listener switched off (two gRPC experiments) the polling
thread reads and writes the socket itself, one thread hand-off fewer each way. On the
2-core VMs this project is measured on, a bare grpc.aio stream round trip went from
0.37 to 0.245 ms p50, and a durable send over shardq's producer stream from 1.77 to
1.55 ms (bench/LATENCY.md: 19 of 20 cells faster, server CPU per call lower in
all 20). At saturation the first check found sends 9-14% faster and the consumer-stream
drain 8% slower; a recheck of six alternating pairs found every saturated phase within
the pairs' spread (drain -1%, server CPU per message unchanged).

gRPC reads its experiments once, when `grpc` is first imported, from GRPC_EXPERIMENTS.
So this is set by the `shardq` command (servers, `shardq local`, the CLI's client
commands) before anything imports gRPC. A program using the client library opts in by
calling `use_completion_queue_polling()` before its first `import grpc` (or importing
anything that does), or by setting GRPC_EXPERIMENTS itself. Setting GRPC_EXPERIMENTS
to anything, even empty, keeps gRPC's own choice: it is never overridden.
"""

from __future__ import annotations

import os
import sys

ENVIRONMENT_VARIABLE = "GRPC_EXPERIMENTS"
COMPLETION_QUEUE_POLLING = "-event_engine_client,-event_engine_listener"


def use_completion_queue_polling() -> bool:
    """Ask gRPC to do socket I/O on its completion-queue polling thread.

    Also inherited by child processes (a `shardq local` cluster's servers). False, and
    nothing changed, when gRPC is already imported (too late) or GRPC_EXPERIMENTS is set.
    """
    if "grpc" in sys.modules or ENVIRONMENT_VARIABLE in os.environ:
        return False
    os.environ[ENVIRONMENT_VARIABLE] = COMPLETION_QUEUE_POLLING
    return True


def describe() -> str:
    """Which engine this process's gRPC was started with, in words (for the server's log)."""
    experiments = os.environ.get(ENVIRONMENT_VARIABLE)
    if experiments == COMPLETION_QUEUE_POLLING:
        return "socket I/O on the completion-queue thread"
    if not experiments:
        return "gRPC's default I/O (EventEngine threads)"
    return f"{ENVIRONMENT_VARIABLE}={experiments}"
