"""What the local lease store's calls cost: the reads and writes a `shardq local` cluster
makes of its leases.

Each replica of a shard reads its lease every 100 ms (runtime.replication.replica), each
server reads every shard's lease every 200 ms for its routes (runtime.forwarding), a
leader renews its lease every quarter of the lease's duration, and the supervisor lists
every lease every tick. This times, on the disk holding --dir, with --samples calls each
(p50 / p90 / p99 in µs) over --leases leases:

  get       one lease, read whole
  renewal   a get, then the update that renews it (the write is on disk before it returns)
  list      every lease, in name order

Usage: python bench/lease_store.py [--dir /path/on/the/disk] [--samples 2000] [--leases 16]
       [--out bench/results]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time

import reports  # bench/reports.py: this script's directory is sys.path[0]
from commit_cost import disk_report, percentiles, timed  # bench/commit_cost.py, beside this script

from shardq.coordination.fencing import build_renewal, build_takeover
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.local_leases import LocalLeaseStore

DURATION_MS = 2_000


def measure(directory: pathlib.Path, *, samples: int, leases: int) -> dict[str, dict[str, float]]:
    path = pathlib.Path(tempfile.mkdtemp(prefix="lease-store-", dir=directory)) / "leases"
    names = [f"orders.{index}" for index in range(leases)]
    try:
        with LocalLeaseStore(path) as store:
            now_ms = int(time.time() * 1000)
            for name in names:
                store.create(
                    build_takeover(LeaseRecord(name=name), new_holder="s1", now_ms=now_ms, duration_ms=DURATION_MS)
                )

            def get(number: int) -> object:
                return store.get(names[number % leases])

            def renew(number: int) -> object:
                seen = store.get(names[number % leases])
                assert seen is not None
                return store.update(build_renewal(seen, now_ms=int(time.time() * 1000)))

            def list_all(_: int) -> object:
                found = store.list("orders.")
                assert len(found) == leases
                return found

            results = {}
            for label, action in (("get", get), ("renewal", renew), ("list", list_all)):
                print(f"[lease-store] {label}: {samples} calls ...", file=sys.stderr, flush=True)
                results[label] = percentiles(timed(samples, action))
            return results
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--samples", type=int, default=2_000)
    parser.add_argument("--leases", type=int, default=16)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write lease-store.json")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    results = measure(args.dir, samples=args.samples, leases=args.leases)
    report = disk_report("lease-store", args.dir, results, samples=args.samples, leases=args.leases)
    reports.emit(report, args.out, "lease-store.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
