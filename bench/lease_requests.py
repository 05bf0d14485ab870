"""API requests an idle shardq cluster sends to kube-apiserver, with and without the lease watch.

A real control plane (etcd, kube-apiserver, kube-controller-manager from e2e/, built once
into the user cache) and real `shardq serve` processes holding their shard leases as
Lease objects (`--lease-store kubernetes`). Three phases, each measured from the API
server's own counter (`apiserver_request_total`, scraped from its /metrics at the start
and the end of a quiet window):

  baseline   the control plane alone (its controllers' requests)
  polling    the servers with `--no-lease-watch`: every lease read is a GET
             (what every server did before the watch)
  watching   the servers as shipped: one list and one watch per server, reads from memory

Each server cluster: --servers servers, one queue of --shards shards with replicas on
every server, leases of --lease-ms (renewed every quarter lease by each shard's leader:
the renewals are writes and stay). The figures are requests per second, total and
for leases by verb. Servers are stopped by PID at the end of each phase.

Usage: python bench/lease_requests.py [--servers 3] [--shards 16] [--seconds 30]
       [--lease-ms 10000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import reports  # bench/reports.py: this script's directory is sys.path[0]
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

# The benchmarks share the tests' support package and the e2e control plane; run as
# `python bench/lease_requests.py`, the repository is not on the path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from e2e.binaries import locate_binaries, require
from e2e.kubecluster import ControlPlane, start_control_plane, stop_control_plane
from shardq import Client
from tests.support.clusters import Cluster, KubernetesLeases
from tests.support.servers import wait_for

SETTLE_S = 5.0


def say(text: str) -> None:
    print(f"[lease-requests {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def request_counts(api: client.ApiClient) -> collections.Counter[tuple[str, str]]:
    """apiserver_request_total summed by (resource, verb), as the API server counts them."""
    answer = api.rest_client.pool_manager.request("GET", f"{api.configuration.host}/metrics")
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for family in text_string_to_metric_families(answer.data.decode()):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                counts[(sample.labels.get("resource", ""), sample.labels.get("verb", ""))] += int(sample.value)
    return counts


def rates(
    before: collections.Counter[tuple[str, str]], after: collections.Counter[tuple[str, str]], seconds: float
) -> dict[str, Any]:
    delta = {key: after[key] - before.get(key, 0) for key in after if after[key] - before.get(key, 0) > 0}
    leases = {
        verb: round(count / seconds, 2) for (resource, verb), count in sorted(delta.items()) if resource == "leases"
    }
    return {
        "total_per_s": round(sum(delta.values()) / seconds, 2),
        "leases_per_s": round(sum(c for (resource, _), c in delta.items() if resource == "leases") / seconds, 2),
        "leases_by_verb_per_s": leases,
    }


def measure_window(api: client.ApiClient, seconds: float) -> dict[str, Any]:
    before = request_counts(api)
    started = time.monotonic()
    while (left := seconds - (time.monotonic() - started)) > 0:
        say(f"  measuring: {left:4.0f} s left")
        time.sleep(min(10.0, left))
    elapsed = time.monotonic() - started
    return rates(before, request_counts(api), elapsed)


def placement(servers: list[str], shards: int) -> list[list[str]]:
    """Every shard on every server, leaders spread round-robin."""
    return [servers[index % len(servers) :] + servers[: index % len(servers)] for index in range(shards)]


def run_phase(
    plane: ControlPlane, api: client.ApiClient, args: argparse.Namespace, root: pathlib.Path, *, watch: bool
) -> dict[str, Any]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    servers = [f"s{number}" for number in range(1, args.servers + 1)]
    cluster = Cluster(
        root / ("watching" if watch else "polling"),
        placement=placement(servers, args.shards),
        lease_ms=args.lease_ms,
        kubernetes=KubernetesLeases(plane.kubeconfig, namespace, watch=watch),
    )
    try:
        for server in servers:
            cluster.start(server)
        with Client(cluster.endpoint(servers[0])) as shardq_client:

            def every_shard_led() -> bool:
                try:
                    routes = shardq_client.describe("orders")
                except Exception:
                    return False
                return len(routes) == args.shards and all(route.leader_address for route in routes)

            wait_for(every_shard_led, timeout=120, interval=0.5, what="every shard to have a leader")
        say(f"  {args.servers} servers up, {args.shards} shards led; settling {SETTLE_S:.0f} s")
        time.sleep(SETTLE_S)
        return measure_window(api, args.seconds)
    finally:
        cluster.stop_all()
        core.delete_namespace(namespace)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each measured window")
    parser.add_argument("--lease-ms", type=int, default=10_000)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write lease-requests.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binaries = locate_binaries()
    require(binaries.etcd, binaries.kube_apiserver, binaries.kube_controller_manager)
    with tempfile.TemporaryDirectory(prefix="shardq-lease-requests-") as scratch:
        root = pathlib.Path(scratch)
        say("starting the control plane")
        plane = start_control_plane(binaries, workdir=root / "control-plane")
        try:
            with plane.api_client() as api:
                say("phase baseline: the control plane alone")
                baseline = measure_window(api, args.seconds)
                say("phase polling: servers with --no-lease-watch")
                polling = run_phase(plane, api, args, root, watch=False)
                say("phase watching: servers with the lease watch")
                watching = run_phase(plane, api, args, root, watch=True)
        finally:
            stop_control_plane(plane)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    result = {
        "benchmark": "lease_requests",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit.stdout.strip(),
        "kubernetes": binaries.kubernetes_version,
        "servers": args.servers,
        "shards": args.shards,
        "replicas": args.servers,
        "lease_ms": args.lease_ms,
        "window_s": args.seconds,
        "baseline": baseline,
        "polling": polling,
        "watching": watching,
    }
    reports.emit(result, args.out, "lease-requests.json")
    say(
        f"API requests/s, idle {args.servers}x{args.shards}: baseline {baseline['total_per_s']}, "
        f"polling {polling['total_per_s']} (leases {polling['leases_per_s']}), "
        f"watching {watching['total_per_s']} (leases {watching['leases_per_s']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
