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
`claim_us_per_message` divides the claim's p50 by the size, and `slopes` give what each
message beyond the smallest size adds (the p50s' difference between the largest and the
smallest size, over their difference in messages): the cost a shared receive of four
callers pays per extra message, with the batch's fixed part taken out. A warm loop that
claims the same messages again and again (aborting each time) costs less than this: here
each batch claims messages no batch touched before, after a durable commit, as a server
does.

--floor times, in turn with shardq's claims and on the same environment, the floor of a
claim in Python over py-lmdb: the same LMDB reads and writes and the same bytes stored
(the delivery, its index entry, the journal's event, the record read for the answer),
with nothing else: no domain objects, no store methods, no dead-lettering, byte limits or
receipts. It is a lower bound, not code shardq could run, and its rows say `"path":
"floor"`. The first floor batch is checked against shardq's own codecs and store: the
deliveries, index entries and journal events it wrote must read back as shardq's claim
would have written them, or the run stops.

Usage: python bench/claim_cost.py [--dir /path/on/the/disk] [--sizes 10,40] [--floor]
       [--samples 300] [--idle-gaps-us 0,500] [--payload-bytes 256] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import struct
import sys
import tempfile
import time
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]
from commit_cost import disk_report, percentiles  # bench/commit_cost.py, beside this script

from shard_server.domain import receiving, sending
from shard_server.domain.context import ShardContext
from shard_server.domain.events import ChangeKind, DeliveryChanged
from shard_server.domain.messages import Delivery, DeliveryState, NewMessage
from shard_server.storage import codecs, keys
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


# The codecs' layouts the floor packs by hand (keys.py's key layouts are public and used as
# they are); check_floor_claims reads what it wrote back through shardq's codecs, so a
# layout that drifted stops the run instead of timing other bytes.
_DELIVERY = struct.Struct(">BIqqqqQQ")  # state, receive count, sent, visible, first, last, epoch, token
_CHANGED_HEAD = struct.Struct(">BBQH")  # tag, kind, seq, reason length
_RECORD_HEAD_BYTES = 28  # seq, sent at, four lengths, body length: the body follows (no group, dedup, attributes)
_CLAIMED = int(DeliveryState.CLAIMED)
_RECEIVED = int(ChangeKind.RECEIVED)
_INDEX_CLAIMED = b"\1"


def floor_claims(
    tx: LmdbShardTransaction, dbs: dict[bytes, Any], *, size: int, now_ms: int, epoch: int
) -> list[tuple[int, bytes]]:
    """Claim the first `size` messages of the delivery index with the LMDB calls and packing
    a claim needs and nothing more; returns (seq, body) per message, what an answer reads.

    Only for this benchmark's fill (fresh messages, no group, dedup id or attributes, none
    due for dead-lettering): it decides nothing, which is why it is a floor."""
    txn = tx.txn
    deliveries, index, messages = dbs[keys.DB_DELIVERY], dbs[keys.DB_INDEX], dbs[keys.DB_MESSAGES]
    get, put = txn.get, txn.put
    index_key, seq_key_of = keys.PAIR, keys.U64  # (visible at, seq) and seq
    visible_at = now_ms + VISIBILITY_TIMEOUT_MS
    cursor = txn.cursor(db=index)
    claimed: list[tuple[int, bytes]] = []
    events: list[bytes] = []
    while len(claimed) < size and cursor.first():
        seq = index_key.unpack(cursor.key())[1]
        seq_key = seq_key_of.pack(seq)
        _, count, sent_at, _, first, _, _, token = _DELIVERY.unpack(get(seq_key, None, deliveries))
        delivery = _DELIVERY.pack(_CLAIMED, count + 1, sent_at, visible_at, first or now_ms, now_ms, epoch, token + 1)
        put(seq_key, delivery, False, True, False, deliveries)
        cursor.delete()
        put(index_key.pack(visible_at, seq), _INDEX_CLAIMED, False, True, False, index)
        events.append(_CHANGED_HEAD.pack(codecs.TAG_CHANGED, _RECEIVED, seq, 0) + delivery)
        claimed.append((seq, get(seq_key, None, messages)[_RECORD_HEAD_BYTES:]))
    # Into the transaction's journal, which the batch's log entry takes: the store's own
    # list, since its methods are what the floor leaves out.
    tx._events.extend(events)
    return claimed


def check_floor_claims(
    environment: ShardEnvironment, claimed: list[tuple[int, bytes]], *, now_ms: int, epoch: int, log_index: int
) -> None:
    """Stop unless what floor_claims wrote reads back as shardq's claim of the same messages."""
    visible_at = now_ms + VISIBILITY_TIMEOUT_MS
    with environment.read() as tx:
        expected_events = []
        for seq, body in claimed:
            record = tx.get_record(seq)
            if record is None or record.body != body:
                raise SystemExit(f"floor: message {seq}'s body is not its record's")
            expected = Delivery(seq, DeliveryState.CLAIMED, record.sent_at_ms, visible_at, 1, now_ms, now_ms, epoch, 1)
            if tx.get_delivery(seq) != expected:
                raise SystemExit(f"floor: message {seq}'s delivery reads {tx.get_delivery(seq)}, not {expected}")
            index_key = keys.index_key(visible_at, seq)
            if tx.txn.get(index_key, None, environment.dbs[keys.DB_INDEX]) != _INDEX_CLAIMED:
                raise SystemExit(f"floor: message {seq} is not indexed as claimed under its claim's deadline")
            expected_events.append(DeliveryChanged(ChangeKind.RECEIVED, expected))
        entries = list(tx.iter_log(from_index=log_index, to_index=log_index + 1))
        seqs = {seq for seq, _ in claimed}
        if any(seq in seqs for _, seq in tx.eligible(now_ms, after=None, limit=tx.message_count())):
            raise SystemExit("floor: a claimed message is still indexed as visible")
    if len(entries) != 1 or list(entries[0].events) != expected_events:
        raise SystemExit("floor: the batch's log entry does not hold shardq's events for its claims")


def claim_batches(
    environment: ShardEnvironment,
    context: ShardContext,
    *,
    paths: list[str],
    sizes: list[int],
    samples: int,
    idle_s: float,
    now_ms: int,
) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """`samples` claim batches of each size by each path ("shardq", "floor"), sizes and
    paths in turn: (claim, commit) seconds by (path, size)."""
    took: dict[tuple[str, int], tuple[list[float], list[float]]] = {
        (path, size): ([], []) for path in paths for size in sizes
    }
    floor_checked = False
    for _ in range(samples):
        for size in sizes:
            for path in paths:

                def claim(tx: LmdbShardTransaction, size: int = size, path: str = path) -> list[Any]:
                    if path == "floor":
                        return floor_claims(tx, environment.dbs, size=size, now_ms=now_ms, epoch=context.epoch)
                    return receiving.receive_messages(
                        tx, context, max_messages=size, visibility_timeout_ms=VISIBILITY_TIMEOUT_MS, now_ms=now_ms
                    ).claimed

                started = time.perf_counter()
                # As the writer thread runs a batch of receives: never written ahead.
                opened = environment.begin_batch(
                    claim, epoch=context.epoch, at_ms=now_ms, write_ahead_if=lambda _: False
                )
                claimed = time.perf_counter()
                opened.commit()
                committed = time.perf_counter()
                if len(opened.result) != size:
                    raise SystemExit(f"claimed {len(opened.result)} of {size}: the fill ran out")
                if path == "floor" and not floor_checked:
                    check_floor_claims(
                        environment, opened.result, now_ms=now_ms, epoch=context.epoch, log_index=opened.index
                    )
                    floor_checked = True
                took[path, size][0].append(claimed - started)
                took[path, size][1].append(committed - claimed)
                if idle_s:
                    time.sleep(idle_s)
    return took


def claim_slope(rows: list[dict[str, Any]], *, path: str, gap_us: int) -> dict[str, Any]:
    """What each message beyond the smallest size adds to a claim batch's p50, in µs."""
    smallest = min(rows, key=lambda row: row["messages"])
    largest = max(rows, key=lambda row: row["messages"])
    extra = largest["claim"]["p50_us"] - smallest["claim"]["p50_us"]
    us = round(extra / (largest["messages"] - smallest["messages"]), 2)
    print(
        f"[claim-cost] {path:6} {gap_us:5} µs apart: {us} µs a message beyond {smallest['messages']}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "path": path,
        "idle_gap_us": gap_us,
        "from_messages": smallest["messages"],
        "to_messages": largest["messages"],
        "us_per_extra_message": us,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--sizes", default="10,40", help="comma-separated messages per claim batch")
    parser.add_argument("--samples", type=int, default=300, help="batches of each size per idle gap")
    parser.add_argument("--idle-gaps-us", default="0,500", help="comma-separated idle gaps after each batch, µs")
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument("--floor", action="store_true", help="time the floor of a claim in Python too (see above)")
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
        paths = ["shardq", "floor"] if args.floor else ["shardq"]
        needed = sum(sizes) * args.samples * max(1, len(gaps_us)) * len(paths)
        sent_at = fill(environment, context, needed, args.payload_bytes)
        # Every message is visible by then, whenever the fill ended.
        now_ms = max(sent_at, int(time.time() * 1000)) + 1_000
        rows: list[dict[str, Any]] = []
        slopes: list[dict[str, Any]] = []
        for gap_us in gaps_us or [0]:
            print(f"[claim-cost] claim batches of {args.sizes}, {gap_us} µs apart ...", file=sys.stderr, flush=True)
            took = claim_batches(
                environment,
                context,
                paths=paths,
                sizes=sizes,
                samples=args.samples,
                idle_s=gap_us / 1e6,
                now_ms=now_ms,
            )
            for path in paths:
                for size in sizes:
                    claim, commit = took[path, size]
                    row = {
                        "path": path,
                        "messages": size,
                        "idle_gap_us": gap_us,
                        "claim": percentiles(claim),
                        "commit": percentiles(commit),
                    }
                    row["claim_us_per_message"] = round(row["claim"]["p50_us"] / size, 2)
                    rows.append(row)
                    print(
                        f"[claim-cost] {path:6} {size:4} messages, {gap_us:5} µs apart: claim p50 "
                        f"{row['claim']['p50_us']} µs ({row['claim_us_per_message']} a message), "
                        f"commit p50 {row['commit']['p50_us']} µs",
                        file=sys.stderr,
                        flush=True,
                    )
                if len(sizes) > 1:
                    slopes.append(claim_slope(rows[-len(sizes) :], path=path, gap_us=gap_us))
    finally:
        environment.close()
        shutil.rmtree(shard_dir, ignore_errors=True)
    report = disk_report(
        "claim-cost", args.dir, rows, payload_bytes=args.payload_bytes, filled_messages=needed, slopes=slopes
    )
    reports.emit(report, args.out, "claim-cost.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
