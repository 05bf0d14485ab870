"""A real Kubernetes control plane as local processes: etcd, kube-apiserver and
kube-controller-manager, all bound to 127.0.0.1 on free ports.

Alone, there is no kubelet and no scheduler: pods stay Pending until a test
plays the kubelet's part with e2e.fakekubelet. With a `ClusterNetwork`, it is
the control plane of the real node (e2e.realnode): the API server listens on
the node's address, reaches the kubelet for logs and exec, and every controller
runs (node lifecycle included, since a real kubelet posts node status).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kubernetes import client

from e2e.binaries import Binaries
from e2e.certificates import KeyPair, NodeIdentity, Pki, build_pki
from e2e.polling import wait_for
from tests.support.ports import free_port

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"  # what k8s' test/integration/framework uses
KUBERNETES_SERVICE_IP = "10.0.0.1"  # the first address of that range
# kube-apiserver writes its advertise address into the `kubernetes` Endpoints and never
# connects to it. Endpoint validation rejects loopback and link-local addresses, and
# the default (the host's default-route interface, which k8s' own integration
# framework relies on) fails on a host without a default route. An RFC 5737
# documentation address is valid everywhere and routes to nothing.
ADVERTISE_ADDRESS = "203.0.113.10"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

_STOP_GRACE_SECONDS = 15.0
_LOG_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ClusterNetwork:
    """Where a real node's cluster lives: the node, and the Service range."""

    node: NodeIdentity
    service_cidr: str
    kubernetes_service_ip: str


class ControlPlaneError(RuntimeError):
    """The control plane failed to start or one of its processes died."""


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if pytest itself is killed, the kernel
    # kills the control plane too instead of leaving servers behind.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        self.log_file.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace: float = _STOP_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL if the process has not exited within `grace` seconds."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=grace)
        self.log_file.close()


@dataclass
class ControlPlane:
    workdir: Path
    server: str
    kubeconfig: Path
    pki: Pki
    kubernetes_version: str
    processes: list[Process] = field(default_factory=list)
    # Set: processes outlive the Python process that started them (`e2e/cluster up`),
    # and their PIDs are written here, numbered in start order, for whoever stops them.
    pid_dir: Path | None = None
    # etcd's client URL, for tests that act on storage directly (compaction).
    etcd_url: str = ""

    def spawn(self, name: str, args: list[str], *, env: dict[str, str] | None = None) -> Process:
        log_path = self.workdir / f"{name}.log"
        log_file = log_path.open("wb")
        popen = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=env,
            # Its own session: a Ctrl-C in the terminal reaches pytest, which then stops
            # the processes in order, rather than every process at once.
            start_new_session=True,
            # Safe here: fixtures spawn from the main thread while no other thread runs.
            preexec_fn=None if self.pid_dir is not None else _die_with_parent,  # noqa: PLW1509
        )
        process = Process(name=name, popen=popen, log_path=log_path, log_file=log_file)
        if self.pid_dir is not None:
            self.pid_dir.mkdir(parents=True, exist_ok=True)
            order = len(list(self.pid_dir.glob("*.pid")))
            (self.pid_dir / f"{order:02d}-{name}.pid").write_text(f"{popen.pid}\n")
        self.processes.append(process)
        return process

    def forget_detached_processes(self) -> None:
        """Hand the detached processes over to their PID files: this Python process
        neither waits for them nor keeps their logs open any more."""
        assert self.pid_dir is not None, "only detached processes outlive their starter"
        for process in self.processes:
            process.log_file.close()
            # Popen warns when collected while its child runs; whoever reads the PID
            # file stops it, so this object stops tracking it.
            process.popen.returncode = 0
        self.processes.clear()

    def ensure_running(self) -> None:
        """Raise ControlPlaneError, with the log's tail, if any process has exited."""
        for process in self.processes:
            code = process.popen.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"{process.name} (pid {process.popen.pid}) exited with {code}; "
                    f"last lines of {process.log_path}:\n{process.log_tail()}"
                )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.popen.pid}) {p.log_path}\n{p.log_tail()}" for p in self.processes)

    def api_client(self, *, user: KeyPair | None = None) -> client.ApiClient:
        """A client of the official `kubernetes` package, as the admin unless `user` given."""
        identity = user or self.pki.admin
        configuration = client.Configuration(
            host=self.server,
            ssl_ca_cert=str(self.pki.ca.cert),
            cert_file=str(identity.cert),
            key_file=str(identity.key),
        )
        return client.ApiClient(configuration)

    def bearer_token_client(self, token: str) -> client.ApiClient:
        """A client that authenticates with a bearer token (e.g. a service account's)."""
        configuration = client.Configuration(
            host=self.server,
            ssl_ca_cert=str(self.pki.ca.cert),
            api_key={"BearerToken": token},
            api_key_prefix={"BearerToken": "Bearer"},
        )
        return client.ApiClient(configuration)

    def stop(self) -> None:
        """Stop every process by PID, newest first (controller manager, apiserver, etcd)."""
        errors: list[str] = []
        for process in reversed(self.processes):
            try:
                process.stop()
            except (OSError, subprocess.SubprocessError) as error:
                errors.append(f"{process.name} (pid {process.popen.pid}): {error!r}")
        self.processes.clear()
        if errors:
            raise ControlPlaneError("could not stop: " + "; ".join(errors))


def compact_etcd(plane: ControlPlane) -> int:
    """Compact etcd's history up to its current revision, as the API server does every
    five minutes: a watch that resumes from an older resourceVersion then gets 410 Gone.
    Returns the revision compacted to. Uses etcd's JSON gateway (no etcdctl needed)."""

    def post(path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(
            f"{plane.etcd_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            result: dict[str, object] = json.load(answer)
            return result

    header = post("/v3/kv/range", {"key": "AA=="})["header"]
    assert isinstance(header, dict)
    revision = int(header["revision"])
    post("/v3/kv/compaction", {"revision": revision, "physical": True})
    return revision


def write_kubeconfig(path: Path, *, server: str, ca: Path, user: str, identity: KeyPair) -> None:
    # JSON is YAML, so every kubeconfig reader (client-go, kubectl, helm, python) takes it.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "shardq-e2e",
                "cluster": {"server": server, "certificate-authority": str(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(identity.cert),
                    "client-key": str(identity.key),
                },
            }
        ],
        "contexts": [{"name": "shardq-e2e", "context": {"cluster": "shardq-e2e", "user": user}}],
        "current-context": "shardq-e2e",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            status: int = response.status
            return status == 200
    except urllib.error.HTTPError:
        return False  # e.g. 500 from /readyz while post-start hooks run


def start_control_plane(
    binaries: Binaries,
    *,
    workdir: Path,
    startup_timeout: float = 120.0,
    network: ClusterNetwork | None = None,
    pid_dir: Path | None = None,
) -> ControlPlane:
    """Start etcd, kube-apiserver and kube-controller-manager and wait until they serve.

    On failure every started process is stopped and the error carries their logs.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    service_ip = network.kubernetes_service_ip if network is not None else KUBERNETES_SERVICE_IP
    pki = build_pki(workdir / "pki", service_ip=service_ip, node=network.node if network is not None else None)
    apiserver_port = free_port()
    host = network.node.ip if network is not None else "127.0.0.1"
    plane = ControlPlane(
        workdir=workdir,
        server=f"https://{host}:{apiserver_port}",
        kubeconfig=workdir / "admin.kubeconfig",
        pki=pki,
        kubernetes_version=binaries.kubernetes_version,
        pid_dir=pid_dir,
    )
    try:
        _start(plane, binaries, apiserver_port=apiserver_port, timeout=startup_timeout, network=network)
    except BaseException as error:
        logs = plane.logs()
        plane.stop()
        if isinstance(error, Exception):
            raise ControlPlaneError(f"control plane did not start: {error}\n{logs}") from error
        raise
    return plane


def _start(
    plane: ControlPlane, binaries: Binaries, *, apiserver_port: int, timeout: float, network: ClusterNetwork | None
) -> None:
    pki = plane.pki
    workdir = plane.workdir
    if network is None:
        bind_address, advertise_address = "127.0.0.1", ADVERTISE_ADDRESS
        service_cidr = SERVICE_CLUSTER_IP_RANGE
        # Every default controller but node lifecycle: with no kubelet to post node
        # status it would mark the fake node unreachable and flip every pod that a
        # test marked Ready back to NotReady (then evict it).
        controllers = "*,-node-lifecycle-controller"
        node_flags: list[str] = []
    else:
        # Pods reach the API server through the `kubernetes` Service, whose endpoint
        # is the advertise address: the node's own.
        bind_address = advertise_address = network.node.ip
        service_cidr = network.service_cidr
        controllers = "*"
        assert pki.node is not None
        node_flags = [
            f"--kubelet-client-certificate={pki.node.apiserver_kubelet_client.cert}",
            f"--kubelet-client-key={pki.node.apiserver_kubelet_client.key}",
            f"--kubelet-certificate-authority={pki.ca.cert}",
            # The node's name would resolve to nothing useful; its address is real.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]

    etcd_client_port, etcd_peer_port = free_port(), free_port()
    etcd_url = plane.etcd_url = f"http://127.0.0.1:{etcd_client_port}"
    peer_url = f"http://127.0.0.1:{etcd_peer_port}"
    plane.spawn(
        "etcd",
        [
            str(binaries.etcd),
            "--name=e2e",
            f"--data-dir={workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=e2e={peer_url}",
            "--initial-cluster-state=new",
            # Test data is thrown away: skipping fsync saves seconds per test on slow disks.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
    )
    wait_for(
        lambda: _http_ok(f"{etcd_url}/health"),
        timeout=timeout,
        what="etcd /health",
        retry_on=(OSError,),
        check=plane.ensure_running,
    )

    plane.spawn(
        "kube-apiserver",
        [
            str(binaries.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={bind_address}",
            f"--secure-port={apiserver_port}",
            f"--advertise-address={advertise_address}",
            f"--cert-dir={workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.apiserver.cert}",
            f"--tls-private-key-file={pki.apiserver.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.service_account_public_key}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={service_cidr}",
            "--profiling=false",
            # Lease watches go to etcd rather than the API server's watch cache, so a
            # watch from a compacted resourceVersion gets the real 410 Gone (the cache
            # would serve it from memory) and lease stores are tested at their worst.
            "--watch-cache-sizes=leases.coordination.k8s.io#0",
            "--v=1",
            *node_flags,
        ],
    )
    admin_tls = ssl.create_default_context(cafile=str(pki.ca.cert))
    admin_tls.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
    wait_for(
        lambda: _http_ok(f"{plane.server}/readyz", admin_tls),
        timeout=timeout,
        what="kube-apiserver /readyz",
        interval=0.25,
        retry_on=(OSError,),
        check=plane.ensure_running,
    )

    write_kubeconfig(
        plane.kubeconfig,
        server=plane.server,
        ca=pki.ca.cert,
        user="shardq-e2e-admin",
        identity=pki.admin,
    )
    controller_manager_kubeconfig = workdir / "controller-manager.kubeconfig"
    write_kubeconfig(
        controller_manager_kubeconfig,
        server=plane.server,
        ca=pki.ca.cert,
        user="system:kube-controller-manager",
        identity=pki.controller_manager,
    )
    plane.spawn(
        "kube-controller-manager",
        [
            str(binaries.kube_controller_manager),
            f"--kubeconfig={controller_manager_kubeconfig}",
            "--use-service-account-credentials=true",
            f"--controllers={controllers}",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--cluster-signing-cert-file={pki.ca.cert}",
            f"--cluster-signing-key-file={pki.ca.key}",
            "--leader-elect=false",
            # Its HTTPS endpoint would default to 0.0.0.0:10257; nothing here needs it.
            "--secure-port=0",
            "--v=1",
        ],
    )
    # The service-account controller creates `default` in every namespace: once it
    # exists, the controller manager is connected and running its controllers.
    wait_for(
        lambda: _http_ok(
            f"{plane.server}/api/v1/namespaces/default/serviceaccounts/default",
            admin_tls,
        ),
        timeout=timeout,
        what="kube-controller-manager to create the default ServiceAccount",
        interval=0.25,
        retry_on=(OSError,),
        check=plane.ensure_running,
    )


def stop_control_plane(plane: ControlPlane, *, keep_workdir: bool = False) -> None:
    """Stop every process, then remove the work dir (certificates, etcd data, logs)."""
    try:
        plane.stop()
    finally:
        if not keep_workdir:
            shutil.rmtree(plane.workdir, ignore_errors=True)
