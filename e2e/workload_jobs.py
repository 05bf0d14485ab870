"""Producer and consumer Jobs that run the recorded workload in pods (e2e/workload_pod.py).

The code the pods run is the fault suite's own (tests/faults/history.py, workload.py),
shipped in a ConfigMap and mounted at /workload; the pods use the shardq client of the
image. The test reads each pod's progress from its log, stops it with SIGTERM, and reads
its history back from its log once the Job has completed.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import pathlib
import subprocess
from typing import Any

from kubernetes import client

from e2e.cluster_tls import CREDENTIALS_MOUNT, credentials_environment, credentials_volume
from e2e.polling import wait_for
from e2e.realnode import NodeInfo
from e2e.workload_pod import HISTORY_PREFIX, PROGRESS_PREFIX
from tests.faults.history import AnyOperation, operation_from_json

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MOUNT = "/workload"
CODE_CONFIGMAP = "workload-code"
# ConfigMap keys cannot hold "/": each file gets a flat key and its path under MOUNT.
CODE_FILES = {
    "workload_pod.py": "e2e/workload_pod.py",
    "tests-init.py": "tests/__init__.py",
    "faults-init.py": "tests/faults/__init__.py",
    "history.py": "tests/faults/history.py",
    "workload.py": "tests/faults/workload.py",
}
JOB_DONE_S = 120.0
# Histories of different processes number their operations from 1: each source's ids are
# moved into its own range when they are merged.
OP_ID_RANGE = 1 << 40


def code_config_map(namespace: str) -> client.V1ConfigMap:
    data = {key: (REPO_ROOT / path).read_text() for key, path in CODE_FILES.items()}
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=CODE_CONFIGMAP, namespace=namespace), data=data)


@dataclasses.dataclass(frozen=True)
class PodCredentials:
    """What the workload's pods show a cluster that serves TLS and asks for tokens: they run
    as `service_account` and mount a token for `audience` and `tls_secret`'s ca.crt."""

    service_account: str
    tls_secret: str
    audience: str


CREDENTIALS_VOLUME = "shardq-credentials"


def job(
    name: str,
    namespace: str,
    *,
    image: str,
    role: str,
    endpoint: str,
    seed: int,
    credentials: PodCredentials | None = None,
) -> client.V1Job:
    items = [client.V1KeyToPath(key=key, path=path.removeprefix("e2e/")) for key, path in sorted(CODE_FILES.items())]
    env = [client.V1EnvVar(name="PYTHONPATH", value=MOUNT)]
    mounts = [client.V1VolumeMount(name="code", mount_path=MOUNT, read_only=True)]
    volumes: list[Any] = [
        client.V1Volume(name="code", config_map=client.V1ConfigMapVolumeSource(name=CODE_CONFIGMAP, items=items))
    ]
    if credentials is not None:
        env += [client.V1EnvVar(name=key, value=value) for key, value in credentials_environment().items()]
        mounts.append(client.V1VolumeMount(name=CREDENTIALS_VOLUME, mount_path=CREDENTIALS_MOUNT, read_only=True))
        volumes.append(
            credentials_volume(CREDENTIALS_VOLUME, audience=credentials.audience, ca_secret=credentials.tls_secret)
        )
    container = client.V1Container(
        name="workload",
        image=image,
        image_pull_policy="Never",
        command=["python3", f"{MOUNT}/workload_pod.py"],
        args=["--role", role, "--endpoint", endpoint, "--seed", str(seed)],
        env=env,
        volume_mounts=mounts,
        resources=client.V1ResourceRequirements(requests={"cpu": "50m", "memory": "96Mi"}),
    )
    pod = client.V1PodSpec(
        restart_policy="Never",
        containers=[container],
        volumes=volumes,
        service_account_name=None if credentials is None else credentials.service_account,
        termination_grace_period_seconds=90,
    )
    return client.V1Job(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels={"app.kubernetes.io/name": "workload"}),
        spec=client.V1JobSpec(
            backoff_limit=0,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels={"app.kubernetes.io/name": "workload", "workload-job": name}),
                spec=pod,
            ),
        ),
    )


@dataclasses.dataclass
class WorkloadJob:
    """One running Job of the workload and the means to follow, stop and read it."""

    name: str
    namespace: str
    core: client.CoreV1Api
    batch: client.BatchV1Api

    def pod(self) -> Any:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"workload-job={self.name}").items
        return pods[0] if len(pods) == 1 else None

    def wait_running(self, *, timeout: float = 120.0) -> None:
        def running() -> bool:
            pod = self.pod()
            return pod is not None and pod.status.phase == "Running" and self.acknowledged() > 0

        wait_for(running, timeout=timeout, interval=0.5, what=f"the {self.name} Job's pod running and acknowledged")

    def log(self, *, tail_lines: int | None = None) -> str:
        pod = self.pod()
        if pod is None:
            return ""
        text: str = self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace, tail_lines=tail_lines)
        return text

    def acknowledged(self) -> int:
        """The operations the pod has had acknowledged, from its latest progress line."""
        lines = [line for line in self.log(tail_lines=5).splitlines() if line.startswith(PROGRESS_PREFIX)]
        return int(lines[-1].removeprefix(PROGRESS_PREFIX)) if lines else 0

    def stop(self, info: NodeInfo) -> None:
        """SIGTERM to the workload (PID 1 of its container), as the kubelet would send it."""
        pod = self.pod()
        assert pod is not None, f"no pod for Job {self.name}"
        command = info.kubectl_command(
            "exec", "-n", self.namespace, pod.metadata.name, "--",
            "python3", "-c", "import os, signal; os.kill(1, signal.SIGTERM)",
        )  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=30)

    def history(self) -> list[AnyOperation]:
        """The pod's recorded history, once its Job has completed (a failed Job fails the test)."""

        def finished() -> str | None:
            status = self.batch.read_namespaced_job_status(self.name, self.namespace).status
            if status.failed:
                return "failed"
            return "succeeded" if status.succeeded else None

        outcome = wait_for(finished, timeout=JOB_DONE_S, interval=0.5, what=f"the {self.name} Job to finish")
        log = self.log()
        assert outcome == "succeeded", f"the {self.name} Job failed; its log ends:\n{log[-4000:]}"
        (encoded,) = [line for line in log.splitlines() if line.startswith(HISTORY_PREFIX)]
        lines = gzip.decompress(base64.b64decode(encoded.removeprefix(HISTORY_PREFIX))).decode().splitlines()
        return [operation_from_json(json.loads(line)) for line in lines]


def start_jobs(
    api: client.ApiClient,
    namespace: str,
    *,
    image: str,
    endpoint: str,
    seed: int,
    credentials: PodCredentials | None = None,
) -> tuple[WorkloadJob, WorkloadJob]:
    """The code ConfigMap, then a producer Job and a consumer Job (showing `credentials`)."""
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    core.create_namespaced_config_map(namespace, code_config_map(namespace))
    started = []
    for role in ("producers", "consumers"):
        name = f"workload-{role}"
        batch.create_namespaced_job(
            namespace,
            job(name, namespace, image=image, role=role, endpoint=endpoint, seed=seed, credentials=credentials),
        )
        started.append(WorkloadJob(name, namespace, core, batch))
    return started[0], started[1]


def merge_histories(*histories: list[AnyOperation]) -> list[AnyOperation]:
    """One history of several processes' histories: op ids made unique, timestamps kept
    (the pods and the test share this machine's clocks)."""
    merged: list[AnyOperation] = []
    for number, operations in enumerate(histories):
        merged += [dataclasses.replace(o, op_id=number * OP_ID_RANGE + o.op_id) for o in operations]
    return merged
