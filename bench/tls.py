"""What TLS costs a call: `bench/latency.py` on a plaintext server (A) and on one serving
TLS (B, `--tls-cert-file`/`--tls-key-file`, the client trusting its CA), alternating,
cell by cell (bench/latency_ab.py).

The certificate is a P-256 ECDSA one from a throw-away CA (e2e.certificates), as
cert-manager would issue by default for ECDSA; each latency run connects its clients
before the clock starts, so what B pays is per call (encryption, framing), not the
handshake, which a long-lived client makes once per connection.

Usage: python bench/tls.py --runs 3 -- --ops 1500 --concurrency 1,4,64
       (arguments after -- go to every latency.py run; writes
        bench/results/latency-ab-tls.{json,png})
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

# Run as `python bench/tls.py` from the repository root, which goes on sys.path here.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from latency_ab import run_alternating, split_passed  # bench/latency_ab.py: this script's directory is sys.path[0]

from e2e.certificates import issue_serving_certificates

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    argv, passed = split_passed(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--label", default="tls")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardq-bench-tls-") as directory:
        issued = issue_serving_certificates(
            pathlib.Path(directory), dns_names=["localhost"], ip_addresses=["127.0.0.1"]
        )
        with_tls = [
            f"--ca-file={issued.ca}",
            f"--server-arg=--tls-cert-file={issued.cert}",
            f"--server-arg=--tls-key-file={issued.key}",
        ]
        print(f"[tls] A: plaintext, B: TLS; {args.runs} runs each, alternating", file=sys.stderr, flush=True)
        return run_alternating(
            label=args.label, a=("plaintext", []), b=("tls", with_tls), runs=args.runs, out=args.out, passed=passed
        )


if __name__ == "__main__":
    raise SystemExit(main())
