"""Shard servers and client pods on the real node, as the operator and users will run them.

Manifests are built with the official client's models; waits poll the API.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.polling import wait_for

GRPC_PORT = 7600
POD_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ShardServers:
    name: str
    namespace: str
    replicas: int

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name}"

    def pod_dns_name(self, ordinal: int) -> str:
        """The stable name a StatefulSet pod gets through its headless Service."""
        return f"{self.name}-{ordinal}.{self.name}-peers.{self.namespace}.svc.cluster.local"

    @property
    def service_dns_name(self) -> str:
        return f"{self.name}.{self.namespace}.svc.cluster.local"


def create_shard_servers(
    api: client.ApiClient, namespace: str, *, name: str, image: str, replicas: int, queue: str
) -> ShardServers:
    """A StatefulSet of `shardq serve` pods with a PVC each, a headless and a client Service."""
    labels = {"app.kubernetes.io/name": "shardq-server", "app.kubernetes.io/instance": name}
    core = client.CoreV1Api(api)
    port = client.V1ServicePort(name="grpc", port=GRPC_PORT, target_port="grpc")
    core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name=f"{name}-peers", labels=labels),
            spec=client.V1ServiceSpec(
                cluster_ip="None", selector=labels, ports=[port], publish_not_ready_addresses=True
            ),
        ),
    )
    core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name=name, labels=labels),
            spec=client.V1ServiceSpec(selector=labels, ports=[port]),
        ),
    )
    container = client.V1Container(
        name="server",
        image=image,
        image_pull_policy="Never",
        # `args`, not `command`: the image's entrypoint (tini) stays PID 1 and reaps,
        # and the server is its child, which a SIGKILL from inside the container can reach.
        args=[
            "shardq",
            "serve",
            "--data-dir",
            "/data",
            "--host",
            "0.0.0.0",
            "--port",
            str(GRPC_PORT),
            "--queue",
            queue,
            "--log-format",
            "text",
        ],
        ports=[client.V1ContainerPort(name="grpc", container_port=GRPC_PORT)],
        readiness_probe=client.V1Probe(grpc=client.V1GRPCAction(port=GRPC_PORT), period_seconds=1),
        volume_mounts=[client.V1VolumeMount(name="data", mount_path="/data")],
        resources=client.V1ResourceRequirements(requests={"cpu": "50m", "memory": "64Mi"}),
    )
    client.AppsV1Api(api).create_namespaced_stateful_set(
        namespace,
        client.V1StatefulSet(
            metadata=client.V1ObjectMeta(name=name, labels=labels),
            spec=client.V1StatefulSetSpec(
                service_name=f"{name}-peers",
                replicas=replicas,
                selector=client.V1LabelSelector(match_labels=labels),
                pod_management_policy="Parallel",
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(containers=[container], termination_grace_period_seconds=10),
                ),
                volume_claim_templates=[
                    client.V1PersistentVolumeClaim(
                        metadata=client.V1ObjectMeta(name="data"),
                        spec=client.V1PersistentVolumeClaimSpec(
                            access_modes=["ReadWriteOnce"],
                            resources=client.V1VolumeResourceRequirements(requests={"storage": "1Gi"}),
                        ),
                    )
                ],
            ),
        ),
    )
    servers = ShardServers(name=name, namespace=namespace, replicas=replicas)
    wait_ready(api, servers)
    return servers


def serving(endpoint: str) -> bool:
    """Whether a shard server answers its gRPC health check at `endpoint` (an application-level
    check: on this machine any TCP connection may "succeed" through the proxy)."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(endpoint: str, *, timeout: float = 60.0) -> None:
    """Until `endpoint` answers: kube-proxy programs a new Service's rules a moment after
    its endpoints become ready."""
    wait_for(lambda: serving(endpoint), timeout=timeout, what=f"a shard server answering at {endpoint}", interval=0.3)


def ready_pods(api: client.ApiClient, servers: ShardServers) -> list[client.V1Pod]:
    pods = client.CoreV1Api(api).list_namespaced_pod(servers.namespace, label_selector=servers.selector).items
    return [
        pod
        for pod in pods
        if pod.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    ]


def wait_ready(api: client.ApiClient, servers: ShardServers, *, timeout: float = POD_READY_TIMEOUT_S) -> None:
    wait_for(
        lambda: len(ready_pods(api, servers)) == servers.replicas,
        timeout=timeout,
        what=f"{servers.replicas} Ready pods of {servers.name}",
        interval=0.5,
    )


def pod(api: client.ApiClient, namespace: str, name: str) -> client.V1Pod:
    return client.CoreV1Api(api).read_namespaced_pod(name, namespace)


def run_python_pod(
    api: client.ApiClient, namespace: str, *, name: str, image: str, script: str, timeout: float = 120.0
) -> tuple[str, str]:
    """Run `python3 -c script` in a pod to completion; returns (phase, logs)."""
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(
                restart_policy="Never",
                termination_grace_period_seconds=1,
                containers=[
                    client.V1Container(
                        name="client", image=image, image_pull_policy="Never", command=["python3", "-c", script]
                    )
                ],
            ),
        ),
    )

    def finished() -> str | None:
        phase: str = core.read_namespaced_pod(name, namespace).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for(finished, timeout=timeout, what=f"pod {name} to finish", interval=0.5)
    logs: str = core.read_namespaced_pod_log(name, namespace)
    return phase, logs


def delete_pod_and_wait_replaced(api: client.ApiClient, servers: ShardServers, ordinal: int) -> client.V1Pod:
    """`kubectl delete pod`: returns the new pod once Ready (a new UID, same name)."""
    core = client.CoreV1Api(api)
    name = f"{servers.name}-{ordinal}"
    old_uid = core.read_namespaced_pod(name, servers.namespace).metadata.uid
    core.delete_namespaced_pod(name, servers.namespace)

    def replaced() -> client.V1Pod | None:
        try:
            current = core.read_namespaced_pod(name, servers.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        ready = any(c.type == "Ready" and c.status == "True" for c in current.status.conditions or [])
        return current if current.metadata.uid != old_uid and ready else None

    new: client.V1Pod = wait_for(replaced, timeout=POD_READY_TIMEOUT_S, what=f"{name} replaced and Ready", interval=0.5)
    return new


# Run inside the server's container: SIGKILL to the `shardq serve` process, the child of
# tini (PID 1), which then exits with it; the kubelet restarts the container.
_KILL_SERVER = (
    "import os, signal\n"
    "mine = str(os.getpid())\n"
    "for pid in [p for p in os.listdir('/proc') if p.isdigit() and p not in ('1', mine)]:\n"
    "    try:\n"
    "        command = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if b'serve' in command and b'shardq' in command:\n"
    "        os.kill(int(pid), signal.SIGKILL)\n"
    "        print(pid)\n"
)


def sigkill_server_process(kubectl: list[str], namespace: str, pod_name: str) -> int:
    """SIGKILL the server process of a pod (works on any cluster: through kubectl exec)."""
    done = subprocess.run(
        [*kubectl, "--namespace", namespace, "exec", pod_name, "--", "python3", "-c", _KILL_SERVER],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    killed = done.stdout.split()
    assert killed, f"no shardq serve process in {pod_name}: {done.stderr}"
    return int(killed[0])
