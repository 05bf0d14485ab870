"""The fault suite's recorded workload as a program in a pod (a producer or a consumer Job).

Runs inside the shardq image with this file and tests/faults/{history,workload}.py mounted
from a ConfigMap (e2e/workload_jobs.py makes it). It talks to the cluster the way an
in-cluster client does: through the client Service's DNS name, each call routed straight
to the shard's leader. Every call's outcome goes into a History.

Output, on stdout (read back with `kubectl logs`, after the pod completed):
- `progress <acknowledged operations>` every second, for the test to see the workload
  move after each fault;
- on SIGTERM (sent by the test when it is done with faults): the producers stop, in-flight
  calls finish or time out, and the history is printed as one line, `history <base64 of
  gzipped JSON lines>`: compressed, because the kubelet rotates a container's log at
  10 MiB and a long run's history would otherwise not survive in it.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import signal
import sys
import threading
import time

from tests.faults.history import History, operation_to_json
from tests.faults.workload import Workload, WorkloadConfig

PROGRESS_EVERY_S = 1.0
HISTORY_PREFIX = "history "
PROGRESS_PREFIX = "progress "


def config_for(role: str, *, seed: int, queue: str, fifo_queue: str) -> WorkloadConfig:
    """Producers only or consumers only: the two Jobs together are the suite's workload."""
    producing = role == "producers"
    return WorkloadConfig(
        seed=seed,
        queue=queue,
        fifo_queue=fifo_queue,
        producers=2 if producing else 0,
        fifo_producers=1 if producing else 0,
        consumers=0 if producing else 2,
        fifo_consumers=0 if producing else 1,
        # The test ends the run with SIGTERM; these only keep the producers from ending first.
        messages_per_producer=50_000,
        send_duration_s=2_500.0,
        call_timeout_s=5.0,
        route_directly=True,
    )


def encode_history(history: History) -> str:
    lines = "".join(
        json.dumps(operation_to_json(operation), sort_keys=True) + "\n"
        for operation in sorted(history.operations(), key=lambda o: o.op_id)
    )
    return base64.b64encode(gzip.compress(lines.encode())).decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("producers", "consumers"), required=True)
    parser.add_argument("--endpoint", required=True, help="host:port of the client Service")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--fifo-queue", default="fifo")
    arguments = parser.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    history = History()
    config = config_for(arguments.role, seed=arguments.seed, queue=arguments.queue, fifo_queue=arguments.fifo_queue)
    workload = Workload(endpoints=lambda: [arguments.endpoint], history=history, config=config)
    workload.start()
    print(f"{arguments.role} started against {arguments.endpoint}", file=sys.stderr, flush=True)
    while not stop.wait(PROGRESS_EVERY_S):
        if workload.errors:
            break
        print(f"{PROGRESS_PREFIX}{workload.ok_operations()}", flush=True)
    started = time.monotonic()
    workload.stop(timeout=60.0)
    print(f"{arguments.role} stopped in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
    print(f"{PROGRESS_PREFIX}{workload.ok_operations()}", flush=True)
    print(f"{HISTORY_PREFIX}{encode_history(history)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
