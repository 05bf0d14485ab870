"""Throughput of an in-cluster producer/consumer pair on the real node, at replicas 1 and 3
(issue 14).

A ShardqCluster of 3 server pods (the node's image, operator as a host process) hosts one
queue per replication factor, 4 shards each. For each, a producer pod and a consumer pod
(bench/pair_pod.py, the image's shardq client, talking to the client Service's DNS name and
routed straight to the leaders) start together, for each N of `--in-flight` (1: one call
at a time, as a web handler or a worker makes them; 32: saturation): the producer keeps N
sends of 256 bytes in flight over the producer stream for `--seconds`; the consumer runs N
loops of receive-10-then-delete until the queue stays empty. Every send is
durable (fsync on the leader; with replicas 3 also in the in-sync followers' logs).

Results: JSON in bench/results/in-cluster-pair.json and a plot beside it. Uses the node
`e2e/cluster up` left running (with the current code's image), else brings one up and
takes it down after.

Usage: python bench/in_cluster_throughput.py [--seconds 30] [--in-flight 1,32] [--replicas 1,3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import sys
import tempfile
import time
import uuid
from typing import Any

from kubernetes import client

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from e2e.crds import install_crds
from e2e.operator_process import running_operator
from e2e.polling import wait_for
from e2e.realnode import Layout, NodeInfo, down, refresh_shardq_image, state_dir, status, up
from e2e.test_operator_runs_queues_on_a_shardq_cluster import GROUP, VERSION, apply, create_cluster, queue_ready

PROGRAM = pathlib.Path(__file__).resolve().parent / "pair_pod.py"
CONFIGMAP = "pair-program"
SERVER_CPU = "400m"


def say(text: str) -> None:
    print(f"[in-cluster-pair {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def pair_pod(name: str, *, image: str, args: list[str]) -> client.V1Pod:
    container = client.V1Container(
        name="pair",
        image=image,
        image_pull_policy="Never",
        command=["python3", "/pair/pair_pod.py"],
        args=args,
        volume_mounts=[client.V1VolumeMount(name="program", mount_path="/pair", read_only=True)],
        resources=client.V1ResourceRequirements(requests={"cpu": "100m", "memory": "64Mi"}),
    )
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app.kubernetes.io/name": "pair"}),
        spec=client.V1PodSpec(
            restart_policy="Never",
            containers=[container],
            volumes=[client.V1Volume(name="program", config_map=client.V1ConfigMapVolumeSource(name=CONFIGMAP))],
        ),
    )


def run_pair(
    core: client.CoreV1Api, namespace: str, image: str, queue: str, *, seconds: float, in_flight: int
) -> dict[str, Any]:
    endpoint = f"main-shardq.{namespace}.svc.cluster.local:7600"
    common = ["--endpoint", endpoint, "--queue", queue, "--seconds", str(seconds), "--in-flight", str(in_flight)]
    names = {role: f"{queue}-{role}" for role in ("producer", "consumer")}
    for role, name in names.items():
        core.create_namespaced_pod(namespace, pair_pod(name, image=image, args=["--role", role, *common]))

    def finished() -> bool:
        phases = {core.read_namespaced_pod(name, namespace).status.phase for name in names.values()}
        if "Failed" in phases:
            logs = {name: core.read_namespaced_pod_log(name, namespace)[-2000:] for name in names.values()}
            raise RuntimeError(f"a pair pod failed: {logs}")
        return phases == {"Succeeded"}

    say(f"{queue}: producer and consumer pods running for {seconds:.0f} s")
    wait_for(finished, timeout=seconds + 180, interval=1.0, what=f"the {queue} pair to finish")
    results = {}
    for role, name in names.items():
        log = core.read_namespaced_pod_log(name, namespace)
        results[role] = json.loads(log.strip().splitlines()[-1])
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    return results


def measure(
    info: NodeInfo, replicas: list[int], *, seconds: float, in_flight: list[int], work: pathlib.Path
) -> list[Any]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    rows = []
    with info.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        try:
            install_crds(api)
            with running_operator(info.kubeconfig, namespace, work / "operator.log"):
                # Requests as a production cluster would set them: a BestEffort server pod
                # gets the smallest CPU share and starves whenever anything else runs.
                create_cluster(
                    api, namespace, info.shardq_image, rebalance={"mode": "off"},
                    resources={"requests": {"cpu": SERVER_CPU, "memory": "256Mi"}},
                )  # fmt: skip
                for factor in replicas:
                    apply(api, namespace, "queues", "Queue", f"pair-r{factor}",
                          {"cluster": "main", "shards": 4, "replicas": factor})  # fmt: skip
                for factor in replicas:
                    wait_for(
                        lambda factor=factor: queue_ready(api, namespace, f"pair-r{factor}"),
                        timeout=300,
                        interval=1.0,
                        what=f"queue pair-r{factor} Ready",
                    )
                program = client.V1ConfigMap(
                    metadata=client.V1ObjectMeta(name=CONFIGMAP), data={"pair_pod.py": PROGRAM.read_text()}
                )
                core.create_namespaced_config_map(namespace, program)
                for calls, factor in ((calls, factor) for calls in in_flight for factor in replicas):
                    result = run_pair(
                        core, namespace, info.shardq_image, f"pair-r{factor}", seconds=seconds, in_flight=calls
                    )
                    rows.append({"replicas": factor, "in_flight": calls, **result})
                    producer, consumer = result["producer"], result["consumer"]
                    say(
                        f"replicas {factor}, {calls} in flight: sent {producer['per_second']:.0f}/s "
                        f"(p50 {producer['send_latency'].get('p50_ms')} ms), "
                        f"received+deleted {consumer['per_second']:.0f}/s, "
                        f"{producer['sent']} sent, {consumer['deleted']} deleted"
                    )
                # Deleted while the operator runs: its finalizers need it.
                custom = client.CustomObjectsApi(api)
                for factor in replicas:
                    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", f"pair-r{factor}")
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "shardqclusters", "main")
                wait_for(
                    lambda: (
                        not any(
                            custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]
                            for plural in ("queues", "shardqclusters")
                        )
                    ),
                    timeout=120,
                    what="the queues and the cluster deleted",
                )
        finally:
            with contextlib.suppress(Exception):
                core.delete_namespace(namespace)
    return rows


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rates, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"replicas {row['replicas']}\n{row['in_flight']} in flight" for row in rows]
    positions = range(len(rows))
    rates.bar([p - 0.2 for p in positions], [row["producer"]["per_second"] for row in rows], 0.4, label="sent/s")
    rates.bar([p + 0.2 for p in positions], [row["consumer"]["per_second"] for row in rows], 0.4, label="deleted/s")
    rates.set_xticks(list(positions), labels)
    rates.set_ylabel("messages per second")
    rates.legend()
    rates.set_title("In-cluster producer/consumer pair")
    for row, position in zip(rows, positions, strict=True):
        figures = row["producer"]["send_latency"]
        latency.bar([position - 0.2], [figures.get("p50_ms", 0)], 0.4, color="tab:blue")
        latency.bar([position + 0.2], [figures.get("p99_ms", 0)], 0.4, color="tab:orange")
    latency.set_xticks(list(positions), labels)
    latency.set_ylabel("send latency, ms (blue p50, orange p99)")
    latency.set_title("Durable send latency at the producer")
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--in-flight", default="1,32", help="calls in flight per pod, comma-separated")
    parser.add_argument("--replicas", default="1,3")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    arguments = parser.parse_args()
    replicas = [int(r) for r in arguments.replicas.split(",") if r]
    in_flight = [int(n) for n in arguments.in_flight.split(",") if n]
    layout = Layout(state_dir())
    healthy, _ = status(layout)
    started_here = not healthy
    if started_here:
        say("bringing the real node up (e2e/cluster up)")
    info = up(layout) if started_here else refresh_shardq_image(layout)
    try:
        with tempfile.TemporaryDirectory(prefix="shardq-pair-") as work:
            rows = measure(info, replicas, seconds=arguments.seconds, in_flight=in_flight, work=pathlib.Path(work))
    finally:
        if started_here:
            down(layout)
    result = {
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "setup": (
            f"3 server pods (each requesting {SERVER_CPU} CPU) on one 2-core node, queues of 4 shards, "
            f"256-byte messages; producer: "
            f"N stream sends in flight for {arguments.seconds:.0f} s; consumer: N loops of receive 10 + delete "
            f"(N = in_flight of each row)"
        ),
        "rows": rows,
    }
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "in-cluster-pair.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, arguments.out / "in-cluster-pair.png")


if __name__ == "__main__":
    main()
