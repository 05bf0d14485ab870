"""What claiming messages costs a shard, made as the server makes it: the per-message work
a shared receive of four callers does four times.

A receive's batch runs on the shard's writer thread: the claims (shardq's own
`receiving.receive_messages` on a real LMDB environment) and the batch's log entry in one
write transaction, answered at once, then LMDB's commit with its syncs, which the shard's
next batch waits for. This runs those batches on a standalone shard's environment (commit
ahead on, claims not written ahead, as `GroupCommitter` runs them), filled beforehand with
--payload-bytes messages, and times each part (p50 / p90 / p99 in µs):

  claim     the write transaction's work: the claims and the log entry (begin_batch)
  commit    LMDB's commit and the meta page's sync (OpenBatch.commit)

for each claim size in --sizes (messages per batch, taken in turn so that the machine's
drift falls on every size alike), back to back and with the thread idle each gap of
--idle-gaps-us after a batch (a server waits that long for the callers' next request).
`claim_us_per_message` divides the claim's p50 by the size. A warm loop that claims the
same messages again and again (aborting each time) costs less than this: here each batch
claims messages no batch touched before, after a durable commit, as a server does.

Usage: python bench/claim_cost.py [--dir /path/on/the/disk] [--sizes 10,40]
       [--samples 300] [--idle-gaps-us 0,500] [--payload-bytes 256] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]
from commit_cost import disk_report, percentiles  # bench/commit_cost.py, beside this script

from shard_server.domain import receiving, sending
from shard_server.domain.context import ShardContext
from shard_server.domain.messages import NewMessage
from shard_server.storage.lmdb_store import LmdbShardTransaction, ShardEnvironment
from shardq.queues import QueueConfig

QUEUE = "claims"
FILL_BATCH = 100
# Long enough that no claim of a run comes back into view during it.
VISIBILITY_TIMEOUT_MS = 3_600_000


def fill(environment: ShardEnvironment, context: ShardContext, messages: int, payload_bytes: int) -> int:
    """Send `messages` messages in batches; returns the time they became visible at (ms)."""
    sent_at = int(time.time() * 1000)
    body = os.urandom(payload_bytes)
    for start in range(0, messages, FILL_BATCH):
        batch = [NewMessage(body, {}, "", "", 0) for _ in range(min(FILL_BATCH, messages - start))]
        environment.write(
            lambda tx, batch=batch: sending.send_messages(tx, context, batch, now_ms=sent_at),
            epoch=context.epoch,
            at_ms=sent_at,
        )
        if start // FILL_BATCH % 50 == 0:
            print(f"[claim-cost] filled {start + len(batch):,} of {messages:,}", file=sys.stderr, flush=True)
    return sent_at


def claim_batches(
    environment: ShardEnvironment,
    context: ShardContext,
    *,
    sizes: list[int],
    samples: int,
    idle_s: float,
    now_ms: int,
) -> dict[int, tuple[list[float], list[float]]]:
    """`samples` claim batches of each size, sizes in turn: (claim, commit) seconds by size."""
    took: dict[int, tuple[list[float], list[float]]] = {size: ([], []) for size in sizes}
    for _ in range(samples):
        for size in sizes:

            def claim(tx: LmdbShardTransaction, size: int = size) -> receiving.ReceiveOutcome:
                return receiving.receive_messages(
                    tx, context, max_messages=size, visibility_timeout_ms=VISIBILITY_TIMEOUT_MS, now_ms=now_ms
                )

            started = time.perf_counter()
            # As the writer thread runs a batch of receives: never written ahead.
            opened = environment.begin_batch(claim, epoch=context.epoch, at_ms=now_ms, write_ahead_if=lambda _: False)
            claimed = time.perf_counter()
            opened.commit()
            committed = time.perf_counter()
            if len(opened.result.claimed) != size:
                raise SystemExit(f"claimed {len(opened.result.claimed)} of {size}: the fill ran out")
            took[size][0].append(claimed - started)
            took[size][1].append(committed - claimed)
            if idle_s:
                time.sleep(idle_s)
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--sizes", default="10,40", help="comma-separated messages per claim batch")
    parser.add_argument("--samples", type=int, default=300, help="batches of each size per idle gap")
    parser.add_argument("--idle-gaps-us", default="0,500", help="comma-separated idle gaps after each batch, µs")
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write claim-cost.json")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    gaps_us = [int(gap) for gap in args.idle_gaps_us.split(",") if gap.strip()]
    if not sizes or min(sizes) < 1 or args.samples < 1:
        parser.error("--sizes needs sizes of at least 1, and --samples at least 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    shard_dir = pathlib.Path(tempfile.mkdtemp(prefix="claim-cost-", dir=args.dir))
    environment = ShardEnvironment(shard_dir, queue=QUEUE, shard=0, map_size=1 << 32, commit_ahead=True)
    try:
        context = ShardContext(QueueConfig(QUEUE, shards=1), 0, 1)
        needed = sum(sizes) * args.samples * max(1, len(gaps_us))
        sent_at = fill(environment, context, needed, args.payload_bytes)
        # Every message is visible by then, whenever the fill ended.
        now_ms = max(sent_at, int(time.time() * 1000)) + 1_000
        rows: list[dict[str, Any]] = []
        for gap_us in gaps_us or [0]:
            print(f"[claim-cost] claim batches of {args.sizes}, {gap_us} µs apart ...", file=sys.stderr, flush=True)
            took = claim_batches(
                environment, context, sizes=sizes, samples=args.samples, idle_s=gap_us / 1e6, now_ms=now_ms
            )
            for size in sizes:
                claim, commit = took[size]
                row = {
                    "messages": size,
                    "idle_gap_us": gap_us,
                    "claim": percentiles(claim),
                    "commit": percentiles(commit),
                }
                row["claim_us_per_message"] = round(row["claim"]["p50_us"] / size, 2)
                rows.append(row)
                print(
                    f"[claim-cost] {size:4} messages, {gap_us:5} µs apart: claim p50 {row['claim']['p50_us']} µs "
                    f"({row['claim_us_per_message']} a message), commit p50 {row['commit']['p50_us']} µs",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        environment.close()
        shutil.rmtree(shard_dir, ignore_errors=True)
    report = disk_report("claim-cost", args.dir, rows, payload_bytes=args.payload_bytes, filled_messages=needed)
    reports.emit(report, args.out, "claim-cost.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
