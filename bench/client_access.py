"""What client authentication costs a call: `bench/latency.py` on a server that admits
every caller (A, `--client-auth none`) and on one that authenticates and authorises
each call (B, `--client-auth kubernetes`), alternating, cell by cell (bench/latency_ab.py).

A real control plane (etcd, kube-apiserver, kube-controller-manager from e2e/, built
once into the user's cache) answers B's TokenReviews and SubjectAccessReviews. A
ServiceAccount with every verb on every queue gets a token for audience `shardq`; both
sides' clients send it (SHARDQ_TOKEN_FILE), so the difference is the server's: reading
the token, and the remembered answers (the API server is asked once a minute per token
and right, so a run asks it a handful of times).

Usage: python bench/client_access.py --runs 5 -- --ops 1500 --concurrency 1,4
       (arguments after -- go to every latency.py run; writes
        bench/results/latency-ab-client-access.{json,png})
       python bench/client_access.py --cached-cost
       (in process, no server: what admitting a call costs once the answers are
        remembered, the case of every call but a client's first each minute; writes
        bench/results/client-access-cached-cost.json)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time
import uuid

from kubernetes import client

# The benchmarks share the e2e control plane; run as `python bench/client_access.py`
# from the repository root, which goes on sys.path here.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from latency_ab import run_alternating, split_passed  # bench/latency_ab.py: this script's directory is sys.path[0]

from e2e.binaries import locate_binaries, require
from e2e.kubecluster import start_control_plane, stop_control_plane
from e2e.queue_rights import EVERY_VERB, account_token, grant
from shard_server.domain.client_access import Identity, Verb
from shard_server.runtime.client_access import ReviewedAccess

HERE = pathlib.Path(__file__).resolve().parent
ACCOUNT = "bench"


def say(text: str) -> None:
    print(f"[client-access] {text}", file=sys.stderr, flush=True)


def account_with_every_right(api: client.ApiClient, namespace: str, token_file: pathlib.Path) -> None:
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=ACCOUNT))
    client.CoreV1Api(api).create_namespaced_service_account(namespace, account)
    grant(api, namespace, ACCOUNT, queue=None, verbs=EVERY_VERB)
    token_file.write_text(account_token(api, namespace, ACCOUNT, audiences=["shardq"], seconds=24 * 3600))
    token_file.chmod(0o600)


class EveryoneMay:
    """Answers as the API server would for an account with every right; only the first
    call of each kind reaches it, the rest are answered from memory."""

    def identity(self, token: str) -> Identity:
        return Identity("system:serviceaccount:bench:bench", uid="u", groups=("system:serviceaccounts",))

    def allows(self, identity: Identity, verb: Verb, queue: str) -> bool:
        return True


def cached_cost(out: pathlib.Path, *, rounds: int = 7, calls: int = 50_000) -> None:
    """Microseconds per admitted call with a ServiceAccount-sized token (about 1 KiB)."""
    token = "t" * 1_000
    metadata = (("user-agent", "grpc-python-asyncio"), ("authorization", f"Bearer {token}"))

    async def measure() -> list[float]:
        access = ReviewedAccess(EveryoneMay())
        await access.require(metadata, (Verb.SEND,), "orders")
        figures = []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(calls):
                await access.require(metadata, (Verb.SEND,), "orders")
            figures.append((time.perf_counter() - started) / calls * 1e6)
        return figures

    figures = asyncio.run(measure())
    result = {
        "benchmark": "client-access-cached-cost",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "calls_per_round": calls,
        "us_per_admitted_call": [round(figure, 3) for figure in figures],
        "median_us": round(sorted(figures)[len(figures) // 2], 3),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "client-access-cached-cost.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"a remembered admission: {result['median_us']} us per call (median of {rounds} rounds of {calls})")


def main(argv: list[str] | None = None) -> int:
    argv, passed = split_passed(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each side, alternating")
    parser.add_argument("--label", default="client-access")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--cached-cost", action="store_true", help="only time a remembered admission, in process")
    args = parser.parse_args(argv)
    if args.cached_cost:
        cached_cost(args.out)
        return 0

    binaries = locate_binaries()
    require(binaries.etcd, binaries.kube_apiserver, binaries.kube_controller_manager)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="shardq-bench-client-access-"))
    say("starting the control plane (etcd, kube-apiserver, kube-controller-manager)")
    plane = start_control_plane(binaries, workdir=workdir)
    try:
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        token_file = workdir / "token"
        with plane.api_client() as api:
            account_with_every_right(api, namespace, token_file)
        authenticated = [
            f"--server-arg={arg}"
            for arg in ("--client-auth=kubernetes", f"--kubeconfig={plane.kubeconfig}", f"--namespace={namespace}")
        ]
        say(f"A: --client-auth none, B: --client-auth kubernetes; {args.runs} runs each, alternating")
        return run_alternating(
            label=args.label,
            a=("open", []),
            b=("authenticated", authenticated),
            runs=args.runs,
            out=args.out,
            passed=passed,
            env={**os.environ, "SHARDQ_TOKEN_FILE": str(token_file)},
        )
    finally:
        say("stopping the control plane")
        stop_control_plane(plane)


if __name__ == "__main__":
    raise SystemExit(main())
