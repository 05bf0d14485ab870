"""Two configurations of `bench/latency.py`, run alternately, compared cell by cell.

This kind of machine (a VM on shared cores) drifts: the same build's p50 moves by half
or more between minutes. Measuring A three times and then B three times would credit B
with the drift; this runs A, B, A, B, ... each time on a fresh server, and reports per
cell (phase x concurrency) the median over each side's runs of p50, p99, calls/s and
server and client CPU per call, with every run's p50 beside it. Writes
latency-ab-LABEL.json and a plot of the p50s (latency-ab-LABEL.png).

Usage: python bench/latency_ab.py --label uvloop --a-name asyncio \
         --a-args "--client-loop asyncio --server-arg=--event-loop=asyncio" \
         --b-name uvloop --b-args "" --runs 3 -- --ops 1000 --concurrency 1,4
       (arguments after -- go to every latency.py run)
       python bench/latency_ab.py --label uvloop --from-runs DIR ...   (combine runs made
       earlier: DIR/latency-NAME-1.json, ...)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
FIGURES = (
    "p50_ms",
    "p99_ms",
    "calls_per_s",
    "server_cpu_us_per_call",
    "client_cpu_us_per_call",
    "spinner_cpu_us_per_call",
    # Runs made before the server exported commit times lack these; a cell skips them then.
    "commit_ms_mean",
    "requests_per_commit",
)


def split_passed(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """This script's arguments, and those after `--`, which go to every latency.py run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def run_alternating(
    *,
    label: str,
    a: tuple[str, list[str]],
    b: tuple[str, list[str]],
    runs: int,
    out: pathlib.Path,
    passed: list[str],
    env: dict[str, str] | None = None,
) -> int:
    """Run this script as a subprocess: side A's and side B's (name, latency.py arguments),
    alternating `runs` times each; for the benchmarks that set up what B needs first."""
    command = [
        sys.executable, str(HERE / "latency_ab.py"), "--label", label,
        "--a-name", a[0], "--a-args", shlex.join(a[1]),
        "--b-name", b[0], "--b-args", shlex.join(b[1]),
        "--runs", str(runs), "--out", str(out), "--", *passed,
    ]  # fmt: skip
    return subprocess.run(command, env=env, check=False).returncode


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv, passed = split_passed(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--a-name", required=True)
    parser.add_argument("--a-args", default="")
    parser.add_argument("--b-name", required=True)
    parser.add_argument("--b-args", default="")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--from-runs", type=pathlib.Path, default=None, help="combine earlier runs instead")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args, passed


def run_side(name: str, number: int, extra: str, passed: list[str], directory: pathlib.Path) -> pathlib.Path:
    label = f"{name}-{number}"
    command = [sys.executable, str(HERE / "latency.py"), *passed, *shlex.split(extra)]
    command += ["--out", str(directory), "--label", label]
    print(f"[latency-ab] {label}: {shlex.join(command[1:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return directory / f"latency-{label}.json"


def combine(reports: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for report in reports:
        for result in report["results"]:
            cells.setdefault((result["phase"], result["concurrency"]), []).append(result)
    combined = {}
    for key, results in cells.items():
        cell: dict[str, Any] = {
            figure: round(statistics.median(r[figure] for r in results), 3)
            for figure in (*FIGURES, "messages_per_s")  # the last only in the worker phases
            if all(figure in r for r in results)
        }
        # No p50 where a phase recorded no latencies (worker.consumer on the old run_consumer).
        cell["p50_ms_each_run"] = [r.get("p50_ms") for r in results]
        combined[key] = cell
    return combined


def plot(path: pathlib.Path, rows: list[dict[str, Any]], a_name: str, b_name: str) -> None:
    """Per concurrency, p50s (cells with latencies on both sides, but `worker`) beside the
    rates (messages per second for the worker loops, calls per second otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rate(cell: dict[str, Any]) -> float:
        return float(cell.get("messages_per_s", cell["calls_per_s"]))

    concurrencies = sorted({row["concurrency"] for row in rows})
    figure, axes = plt.subplots(len(concurrencies), 2, figsize=(15, 3.6 * len(concurrencies)), squeeze=False)
    for (latency_axis, rate_axis), concurrency in zip(axes, concurrencies, strict=True):
        at_c = [row for row in rows if row["concurrency"] == concurrency]
        # A `worker` call is a receive and its ten deletes: its p50 would dwarf the rest.
        timed = [
            row for row in at_c if row["phase"] != "worker" and "p50_ms" in row[a_name] and "p50_ms" in row[b_name]
        ]
        for axis, chosen, figure_of, label in (
            (latency_axis, timed, lambda cell: cell["p50_ms"], "p50 ms (median of runs)"),
            (rate_axis, at_c, rate, "calls or messages per s (median)"),
        ):
            positions = range(len(chosen))
            axis.bar([p - 0.2 for p in positions], [figure_of(r[a_name]) for r in chosen], 0.4, label=a_name)
            axis.bar([p + 0.2 for p in positions], [figure_of(r[b_name]) for r in chosen], 0.4, label=b_name)
            axis.set_xticks(list(positions), [r["phase"] for r in chosen], rotation=20, fontsize=8)
            axis.set_ylabel(label)
            axis.set_title(f"{concurrency} call(s) in flight")
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args, passed = parse_args(argv)
    sides = ((args.a_name, args.a_args), (args.b_name, args.b_args))
    paths: dict[str, list[pathlib.Path]] = {name: [] for name, _ in sides}
    if args.from_runs is not None:
        for name, _ in sides:
            paths[name] = sorted(args.from_runs.glob(f"latency-{name}-*.json"))
            if not paths[name]:
                raise SystemExit(f"latency_ab: no runs named latency-{name}-*.json in {args.from_runs}")
    else:
        directory = pathlib.Path(tempfile.mkdtemp(prefix="shardq-latency-ab-"))
        for number in range(1, args.runs + 1):
            for name, extra in sides:
                paths[name].append(run_side(name, number, extra, passed, directory))
    reports = {name: [json.loads(path.read_text()) for path in paths[name]] for name, _ in sides}
    a, b = (combine(reports[name]) for name, _ in sides)
    rows = [
        {"phase": phase, "concurrency": concurrency, args.a_name: a[(phase, concurrency)], args.b_name: cell}
        for (phase, concurrency), cell in b.items()
        if (phase, concurrency) in a
    ]
    for row in rows:
        before, after = row[args.a_name], row[args.b_name]
        print(
            f"[latency-ab] C={row['concurrency']:<3} {row['phase']:17} p50 {before.get('p50_ms', 0):7.2f} -> "
            f"{after.get('p50_ms', 0):7.2f} ms   server {before['server_cpu_us_per_call']:6.0f} -> "
            f"{after['server_cpu_us_per_call']:6.0f} us/call   spinners "
            f"{before.get('spinner_cpu_us_per_call', 0):6.0f} -> "
            f"{after.get('spinner_cpu_us_per_call', 0):6.0f} us/call",
            file=sys.stderr,
        )
    report = {
        "benchmark": "latency-ab",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sides": {name: {"latency_args": extra, "runs": len(paths[name])} for name, extra in sides},
        "latency_args_both": passed,
        "order": "alternating A, B, A, B, ... each run on a fresh server",
        "cell_figures": "median over the side's runs of each figure; p50_ms_each_run in run order",
        "commits": {name: sorted({r.get("commit", "") for r in reports[name]}) for name, _ in sides},
        "load_average_before_after_each_run": {
            name: [r["load_average_before_after_each_run"] for r in reports[name]] for name, _ in sides
        },
        "cpu_count": os.cpu_count(),
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"latency-ab-{args.label}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(args.out / f"latency-ab-{args.label}.png", rows, args.a_name, args.b_name)
    print(f"[latency-ab] wrote {args.out / f'latency-ab-{args.label}.json'} and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
