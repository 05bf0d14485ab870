"""Time from a leader's death to the first acknowledged send on its failed-over shard, on
the real node, with the operator deciding the failover (issue 13).

A ShardqCluster of 3 server pods (the node's image) hosts a queue of 2 shards with 3
replicas. A sender keeps one send to shard 0 in flight at a time (through the client
Service, as a host client must: the server forwards to the leader). Each trial:

  1. wait until the cluster is settled (every shard led, every replica in sync, all pods ready);
  2. kill shard 0's leader: its pod deleted with no grace period (`pod`), or its server
     process SIGKILLed inside the container (`process`: the kubelet restarts it in place);
  3. the time is from the kill to the first send acknowledged after it that the new
     leader answered (a send acknowledged by the dying leader before it died is not it:
     only an acknowledgement after a failed send, or of a send that waited out the
     failover, counts, and the Shard's epoch must have moved). The server a send reaches
     holds a send for a dead leader's shard until the next leader takes it (for up to
     10 s), so the sends after the one in flight at the kill wait rather than fail; the
     failed sends of each trial are recorded with their reasons.
  4. A leader handing off on SIGTERM (`pod`) answers the sends it took and passes its
     lease at once, so a trial may see no send fail or wait at all: it is recorded as
     unnoticed by the sender (no recovery time), once a send begun after the Shard's
     new leader was seen is acknowledged. Every trial also records the longest any send
     took from the kill on (`longest_send_s`), what the failover cost the producer.

Results: per kind, recovery p50 / max over the trials the sender noticed, how many it
did not, and the longest send's p50 / max; every trial; JSON in
bench/results/failover-real-node.json and a plot of the longest sends beside it. Uses
the node `e2e/cluster up` left running, else brings one up for the run and takes it
down after.

Usage: python bench/failover_time.py [--trials 10] [--kinds pod,process] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import grpc
from kubernetes import client

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from e2e.crds import install_crds
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from e2e.processes import server_pid
from e2e.realnode import Layout, NodeInfo, down, state_dir, status, up
from e2e.test_operator_runs_queues_on_a_shardq_cluster import apply, create_cluster, queue_ready, shard_leaders
from shardq.api.v1 import queue_pb2, queue_pb2_grpc
from shardq.status import error_from_rpc

SEND_TIMEOUT_S = 12.0  # above the 10 s a server holds a send for a shard without a leader
# A send answered this long after it went out waited for the failover: sends to a led
# shard through the Service take milliseconds.
WAITED_OUT_S = 0.1
TRIAL_TIMEOUT_S = 60.0


def say(text: str) -> None:
    print(f"[failover-time {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Sender(threading.Thread):
    """One send to shard 0 in flight at a time; records (monotonic time sent, answered,
    the failure's reason or "" when acknowledged)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.answers: list[tuple[float, float, str]] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            sent = 0
            while not self.stopping.is_set():
                request = queue_pb2.SendMessagesRequest(
                    queue="timed", shard=0, messages=[queue_pb2.MessageToSend(body=f"m{sent}".encode())]
                )
                sent += 1
                began = time.monotonic()
                try:
                    response = stub.SendMessages(request, timeout=SEND_TIMEOUT_S)
                    failure = next((r.error.reason for r in response.results if r.HasField("error")), "")
                except grpc.RpcError as error:
                    failure = error_from_rpc(error).reason.value
                with self.lock:
                    self.answers.append((began, time.monotonic(), failure))
                if failure:
                    time.sleep(0.01)

    def unnoticed_since(self, start: float, led_again: float) -> bool:
        """Whether the failover went by without any send failing or waiting: every send
        answered since `start` was acknowledged at once, and one begun after the new
        leader was seen (`led_again`) was acknowledged too."""
        with self.lock:
            answers = [answer for answer in self.answers if answer[1] >= start]
        if any(failure or answered - max(began, start) >= WAITED_OUT_S for began, answered, failure in answers):
            return False
        return any(began >= led_again for began, _, _ in answers)

    def longest_send(self, start: float, end: float) -> float:
        """The longest any send answered between `start` and `end` took, counted from
        `start` for one already in flight then: what the failover cost a producer."""
        with self.lock:
            answers = [answer for answer in self.answers if start <= answer[1] <= end]
        return max((answered - max(began, start) for began, answered, _ in answers), default=0.0)

    def first_recovery_after(self, start: float) -> tuple[float, list[str]] | None:
        """When the first send acknowledged after a failure following `start`, or after
        waiting out the failover, was answered; and the reasons of the sends that failed
        before it."""
        with self.lock:
            answers = [answer for answer in self.answers if answer[1] >= start]
        failed: list[str] = []
        for began, answered, failure in answers:
            if failure:
                failed.append(failure)
            elif failed or answered - max(began, start) >= WAITED_OUT_S:
                return answered, failed
        return None


def kill(kind: str, api: client.ApiClient, namespace: str, victim: str) -> None:
    if kind == "pod":
        client.CoreV1Api(api).delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    else:
        os.kill(server_pid(namespace, victim), signal.SIGKILL)


def settled(api: client.ApiClient, namespace: str) -> bool:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace).items
    ready = [
        pod
        for pod in pods
        if pod.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    ]
    return len(ready) == 3 and queue_ready(api, namespace, "timed") is not None


def run_trials(info: NodeInfo, trials: int, kinds: list[str], work: pathlib.Path) -> dict[str, Any]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    with info.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        try:
            install_crds(api)
            with running_operator(info.kubeconfig, namespace, work / "operator.log"):
                create_cluster(api, namespace, info.shardq_image, rebalance={"mode": "off"})
                apply(api, namespace, "queues", "Queue", "timed", {"cluster": "main", "shards": 2, "replicas": 3})
                wait_for(lambda: settled(api, namespace), timeout=300, interval=1.0, what="the cluster settled")
                service_ip = core.read_namespaced_service("main-shardq", namespace).spec.cluster_ip
                sender = Sender(f"{service_ip}:7600")
                sender.start()
                try:
                    for trial in range(trials):
                        for kind in kinds:
                            wait_for(lambda: settled(api, namespace), timeout=300, interval=0.5, what="settled")
                            time.sleep(2.0)  # a steady stream of acknowledged sends before the kill
                            victim, epoch = shard_leaders(api, namespace, "timed")[0]
                            killed = time.monotonic()
                            kill(kind, api, namespace, victim)
                            leader, new_epoch = wait_for(
                                lambda victim=victim, epoch=epoch: (
                                    found
                                    if (found := shard_leaders(api, namespace, "timed")[0])[1] > epoch
                                    and found[0] != victim
                                    else None
                                ),
                                timeout=TRIAL_TIMEOUT_S,
                                what="the Shard's new leader",
                            )
                            led_again = time.monotonic()
                            # A hand-off can go by unnoticed: no send fails or waits, and
                            # then there is no recovery to time (the trial says so).
                            outcome = wait_for(
                                lambda killed=killed, led_again=led_again: (
                                    sender.first_recovery_after(killed)
                                    or ("unnoticed" if sender.unnoticed_since(killed, led_again) else None)
                                ),
                                timeout=TRIAL_TIMEOUT_S,
                                interval=0.05,
                                what=f"a send acknowledged after killing {victim}",
                            )
                            recovered, failed = (None, []) if outcome == "unnoticed" else outcome
                            seconds = None if recovered is None else recovered - killed
                            longest = sender.longest_send(killed, recovered or time.monotonic())
                            results[kind].append(
                                {
                                    "trial": trial,
                                    "victim": victim,
                                    "leader": leader,
                                    "epoch": new_epoch,
                                    "seconds": seconds,
                                    "longest_send_s": longest,
                                    "failed_sends": failed,
                                }
                            )
                            took = "unnoticed by the sender" if seconds is None else f"in {seconds:.2f} s"
                            say(
                                f"{kind} trial {trial + 1}/{trials}: {victim} -> {leader} {took}, "
                                f"longest send {longest:.2f} s, sends failed: {', '.join(failed) or 'none'}"
                            )
                finally:
                    sender.stopping.set()
                    sender.join(timeout=10)
                client.CustomObjectsApi(api).delete_namespaced_custom_object(
                    "shardq.io", "v1alpha1", namespace, "queues", "timed"
                )
                wait_for(lambda: queue_ready(api, namespace, "timed") is None, timeout=60, what="queue deleted")
        finally:
            with contextlib.suppress(Exception):
                core.delete_namespace(namespace)
    summary = {kind: summarize(rows) for kind, rows in results.items() if rows}
    return {"summary": summary, "trials": results}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Recovery times over the trials the sender noticed; the longest send over all."""
    noticed = [row["seconds"] for row in rows if row["seconds"] is not None]
    longest = [row["longest_send_s"] for row in rows]
    return {
        "trials": len(rows),
        "unnoticed": len(rows) - len(noticed),
        "p50_s": statistics.median(noticed) if noticed else None,
        "max_s": max(noticed, default=None),
        "min_s": min(noticed, default=None),
        "longest_send_p50_s": statistics.median(longest),
        "longest_send_max_s": max(longest),
        "failed_sends": sum(len(row["failed_sends"]) for row in rows),
    }


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    for offset, (kind, rows) in enumerate(result["trials"].items()):
        longest = [row["longest_send_s"] for row in rows]
        axes.scatter([offset + 1] * len(longest), longest, alpha=0.7, label=kind)
        axes.hlines(statistics.median(longest), offset + 0.75, offset + 1.25, colors="black")
    axes.set_xticks(range(1, len(result["trials"]) + 1), [f"leader {kind} killed" for kind in result["trials"]])
    axes.set_ylabel("longest a send took (s)")
    axes.set_title("Failover on the real node (operator-driven), each dot a trial, bar = p50")
    axes.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kinds", default="pod,process", help="pod (deleted), process (SIGKILLed); comma-separated")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    arguments = parser.parse_args()
    kinds = [kind for kind in arguments.kinds.split(",") if kind]
    if not set(kinds) <= {"pod", "process"}:
        parser.error(f"--kinds: unknown {sorted(set(kinds) - {'pod', 'process'})}")
    layout = Layout(state_dir())
    healthy, _ = status(layout)
    started_here = not healthy
    if started_here:
        say("bringing the real node up (e2e/cluster up)")
    info = up(layout) if started_here else NodeInfo.load(layout.info)
    try:
        with tempfile.TemporaryDirectory(prefix="shardq-failover-") as work:
            result = run_trials(info, arguments.trials, kinds, pathlib.Path(work))
    finally:
        if started_here:
            down(layout)
    result["measured_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result["setup"] = "3 server pods, queue of 2 shards x 3 replicas, lease 3 s, one send in flight to shard 0"
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "failover-real-node.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, arguments.out / "failover-real-node.png")
    for kind, figures in result["summary"].items():
        recovery = (
            "no recovery to time"
            if figures["p50_s"] is None
            else f"recovery p50 {figures['p50_s']:.2f} s, max {figures['max_s']:.2f} s"
        )
        say(
            f"{kind}: {figures['trials']} trials, {figures['unnoticed']} unnoticed by the sender; {recovery}; "
            f"longest send p50 {figures['longest_send_p50_s']:.2f} s, max {figures['longest_send_max_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
