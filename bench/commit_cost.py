"""What one durable commit costs on this disk, below shardq: the floor under a send.

A send on a replicated shard (or a server run with --no-commit-ahead) is answered after
its LMDB write transaction commits. LMDB commits in two synchronous steps: it writes the
transaction's dirty pages and fdatasyncs them, then writes the meta page through a second
descriptor opened with O_DSYNC. A standalone shard answers once its log entry is written
ahead, and LMDB then commits without the meta sync (the .commit-ahead rows). This measures, on
the disk holding --dir, with --samples commits each (p50 / p90 / p99 in µs):

  fdatasync.pages-N   pwrite N scattered 4 KiB pages of a file, then fdatasync
  fdatasync.contiguous-pages-N
                      the same N pages side by side, in one pwrite: what the scattered
                      rows pay per separate write request the disk gets (an LMDB commit's
                      dirty pages lie where its free list had room, rarely side by side)
  meta.o_dsync        one 120-byte pwrite through an O_DSYNC descriptor (LMDB's meta write)
  lmdb.send           a py-lmdb write transaction shaped like one shardq send (a message,
                      its delivery record, its index entry, two meta counters and a log
                      entry, in five sub-databases), committed durably
                      (with writes_per_commit and pages_per_commit: how many write calls
                      and 4 KiB pages each commit handed the kernel, meta page included,
                      read from /proc/self/io; LMDB writes side-by-side pages in one call)
  lmdb.send.nosync    the same transaction with sync and metasync off: its CPU alone
  lmdb.send.idle-600-us.pinned-K
                      durable commits 0.6 ms apart with a read transaction held open and
                      renewed every K commits (--pinned-reader-commits), the file written
                      ahead with zeros: LMDB then takes its pages from the end of the
                      file, side by side, at the price of the pages the reader holds back
                      (used_mib against the unpinned rows')
  lmdb.send.idle-N-us the durable transaction again, the thread sleeping N µs after each
                      commit (--idle-gaps-us): a server with one call in flight waits that
                      long for the next call (the answer's and the next request's way through
                      gRPC and the client), and on a virtual machine a commit after the disk
                      and the CPU sat idle costs more than one right after another
  lmdb.send.idle-N-us.commit-ahead
                      what a standalone shard does (shard_server/storage/commit_ahead.py):
                      the same transaction's log entry written first through an O_DSYNC
                      descriptor into a file written ahead with zeros (ahead_p50_us: what
                      the answer waits for), then LMDB's commit without its meta sync
                      (commit_p50_us); the row's percentiles are of the two together

Usage: python bench/commit_cost.py [--dir /path/on/the/disk] [--samples 1000]
       [--idle-gaps-us 600,2000] [--pinned-reader-commits 250,1000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import random
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lmdb
import reports  # bench/reports.py: this script's directory is sys.path[0]

PAGE = 4096
PAGE_COUNTS = (1, 2, 4, 10, 20)
# Room written ahead of LMDB's pages for the pinned-reader rows: more than they use.
WRITTEN_AHEAD_BYTES = 128 << 20
# One slot of the commit-ahead file (shard_server/storage/commit_ahead.py).
AHEAD_SLOT = 1 << 20


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] * 1e6, 1)

    return {"p50_us": at(0.5), "p90_us": at(0.9), "p99_us": at(0.99), "samples": len(ordered)}


def timed(samples: int, action: Callable[[int], object], *, idle_s: float = 0.0) -> list[float]:
    """How long each of `samples` actions took; with `idle_s`, the thread sleeps that long
    after each one (outside the measurement)."""
    took = []
    for number in range(samples):
        started = time.perf_counter()
        action(number)
        took.append(time.perf_counter() - started)
        if idle_s:
            time.sleep(idle_s)
    return took


def file_syncs(directory: pathlib.Path, samples: int) -> dict[str, dict[str, float]]:
    path = directory / "sync-probe.bin"
    pages = 2_000
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    meta = os.open(path, os.O_RDWR | os.O_DSYNC)
    try:
        os.pwrite(descriptor, b"\0" * (PAGE * pages), 0)  # written, not sparse: no block allocation in the loop
        os.fsync(descriptor)
        rng = random.Random(7)
        results = {}
        for count in PAGE_COUNTS:

            def write_and_sync(_: int, count: int = count) -> None:
                for page in rng.sample(range(2, pages), count):
                    os.pwrite(descriptor, b"y" * PAGE, page * PAGE)
                os.fdatasync(descriptor)

            def write_side_by_side_and_sync(_: int, count: int = count) -> None:
                first = rng.randrange(2, pages - count)
                os.pwrite(descriptor, b"y" * (PAGE * count), first * PAGE)
                os.fdatasync(descriptor)

            results[f"fdatasync.pages-{count}"] = percentiles(timed(samples, write_and_sync))
            if count > 1:
                side_by_side = timed(samples, write_side_by_side_and_sync)
                results[f"fdatasync.contiguous-pages-{count}"] = percentiles(side_by_side)
        results["meta.o_dsync"] = percentiles(timed(samples, lambda _: os.pwrite(meta, b"m" * 120, PAGE + 32)))
        return results
    finally:
        os.close(meta)
        os.close(descriptor)
        path.unlink()


def disk_report(benchmark: str, directory: pathlib.Path, results: Any, **fields: Any) -> dict[str, Any]:
    """A report of a benchmark on the disk holding `directory`: when and where it ran, with
    `fields`, the load average and LMDB's version, around `results`."""
    return {
        "benchmark": benchmark,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "directory": str(directory),
        **fields,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "lmdb": lmdb.__version__,
        "results": results,
    }


def write_calls_and_bytes() -> tuple[int, int]:
    """This process's write system calls and bytes written so far (Linux's /proc/self/io)."""
    counters = dict(line.split(": ") for line in pathlib.Path("/proc/self/io").read_text().splitlines())
    return int(counters["syscw"]), int(counters["wchar"])


def lmdb_send_commits(
    directory: pathlib.Path,
    samples: int,
    *,
    durable: bool,
    idle_s: float = 0.0,
    pin_every: int = 0,
    commit_ahead: bool = False,
) -> tuple[list[float], dict[str, float]]:
    """The durations of `samples` send-shaped commits, and their write calls and pages
    per commit with the MiB of pages LMDB used at the end.

    With `pin_every` K, a read transaction is held open and renewed every K commits, and
    the data file is written ahead with zeros first (so that commits do not grow it):
    LMDB cannot reuse pages freed after the oldest reader began, so it takes new pages
    from the end of its file, side by side.

    With `commit_ahead`, each transaction's log entry is first written through an O_DSYNC
    descriptor into one of two 1 MiB slots of a file written with zeros, and LMDB commits
    without its meta sync (as a standalone shard does); the split between the two is
    reported as ahead_p50_us and commit_p50_us."""
    path = pathlib.Path(tempfile.mkdtemp(dir=directory, prefix="lmdb-probe-"))
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=8, sync=durable, metasync=durable and not commit_ahead)
    pinned: lmdb.Transaction | None = None
    ahead_fd = -1
    ahead_took: list[float] = []
    commit_took: list[float] = []
    if commit_ahead:
        (path / "commit-ahead").write_bytes(bytes(AHEAD_SLOT * 2))
        ahead_fd = os.open(path / "commit-ahead", os.O_RDWR | os.O_DSYNC)
    try:
        names = (b"messages", b"delivery", b"index", b"meta", b"log")
        messages, delivery, index, meta, log = (env.open_db(name) for name in names)
        body = b"x" * 300

        def send(number: int) -> None:
            nonlocal pinned
            if pin_every and number % pin_every == 0:
                if pinned is not None:
                    pinned.abort()
                pinned = env.begin()
            seq = struct.pack(">Q", number + 1)
            entry = b"e" * 320
            with env.begin(write=True) as txn:
                txn.put(seq, body, db=messages)
                txn.put(seq, b"d" * 30, db=delivery)
                txn.put(struct.pack(">QQ", 1_000 + number, number), b"", db=index)
                txn.put(b"last_seq", seq, db=meta)
                txn.put(b"last_index", seq, db=meta)
                txn.put(seq, entry, db=log, append=True)
                if commit_ahead:
                    started = time.perf_counter()
                    os.pwrite(ahead_fd, b"h" * 28 + entry, (number % 2) * AHEAD_SLOT)
                    written = time.perf_counter()
                    ahead_took.append(written - started)
            if commit_ahead:
                commit_took.append(time.perf_counter() - written)

        warm = max(samples // 5, 50)
        timed(warm, send)  # grow the trees first: the measured commits touch settled pages
        if pin_every:
            with env.begin(write=True), (path / "data.mdb").open("ab") as data:  # no commit writes meanwhile
                data.write(bytes(WRITTEN_AHEAD_BYTES))
                data.flush()
                os.fsync(data.fileno())
        calls_before, bytes_before = write_calls_and_bytes()
        took = timed(samples, lambda number: send(number + warm), idle_s=idle_s)
        calls_after, bytes_after = write_calls_and_bytes()
        figures = {
            "writes_per_commit": round((calls_after - calls_before) / samples, 2),
            "pages_per_commit": round((bytes_after - bytes_before) / PAGE / samples, 2),
            "used_mib": round((env.info()["last_pgno"] + 1) * PAGE / 2**20, 1),
        }
        if commit_ahead:
            figures["ahead_p50_us"] = percentiles(ahead_took[-samples:])["p50_us"]
            figures["commit_p50_us"] = percentiles(commit_took[-samples:])["p50_us"]
        return took, figures
    finally:
        if pinned is not None:
            pinned.abort()
        if ahead_fd >= 0:
            os.close(ahead_fd)
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--samples", type=int, default=1_000)
    parser.add_argument(
        "--idle-gaps-us",
        default="600,2000",
        help="comma-separated idle gaps between durable commits, in µs (empty for none)",
    )
    parser.add_argument(
        "--pinned-reader-commits",
        default="250,1000",
        help="comma-separated K: durable commits 0.6 ms apart with a reader renewed every K commits (empty: none)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write commit-cost.json")
    args = parser.parse_args(argv)
    gaps_us = [int(gap) for gap in args.idle_gaps_us.split(",") if gap.strip()]
    pins = [int(every) for every in args.pinned_reader_commits.split(",") if every.strip()]
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"[commit-cost] file syncs on {args.dir} ...", file=sys.stderr, flush=True)
    results: dict[str, Any] = file_syncs(args.dir, args.samples)
    print("[commit-cost] LMDB send-shaped commits ...", file=sys.stderr, flush=True)
    commits, writes = lmdb_send_commits(args.dir, args.samples, durable=True)
    results["lmdb.send"] = {**percentiles(commits), **writes}
    commits, _ = lmdb_send_commits(args.dir, args.samples, durable=False)
    results["lmdb.send.nosync"] = percentiles(commits)
    for gap_us in gaps_us:
        print(f"[commit-cost] durable commits {gap_us} µs apart ...", file=sys.stderr, flush=True)
        commits, writes = lmdb_send_commits(args.dir, args.samples, durable=True, idle_s=gap_us / 1e6)
        results[f"lmdb.send.idle-{gap_us}-us"] = {**percentiles(commits), **writes}
        commits, writes = lmdb_send_commits(
            args.dir, args.samples, durable=True, idle_s=gap_us / 1e6, commit_ahead=True
        )
        results[f"lmdb.send.idle-{gap_us}-us.commit-ahead"] = {**percentiles(commits), **writes}
    for every in pins:
        print(f"[commit-cost] durable commits 600 µs apart, a reader renewed every {every} ...", file=sys.stderr)
        commits, writes = lmdb_send_commits(args.dir, args.samples, durable=True, idle_s=600e-6, pin_every=every)
        results[f"lmdb.send.idle-600-us.pinned-{every}"] = {**percentiles(commits), **writes}
    reports.emit(disk_report("commit-cost", args.dir, results), args.out, "commit-cost.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
