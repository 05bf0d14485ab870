"""A real single-node Kubernetes on this machine: pods really run our image.

One module starts and stops the whole stack, by PID, under one state directory:
the control plane of e2e.kubecluster (API server on the node's address, every
controller), containerd (its own config, state and socket) with runc, the kubelet
(cgroupfs, x509 client auth, a serving certificate so logs/exec/port-forward
work), the scheduler, kube-proxy (iptables), CoreDNS as a host process behind
the `kube-dns` Service, a `local` StorageClass with pre-created volumes, and the
images of e2e.images imported without a registry.

Addresses come from ranges nothing outside this machine uses: the node is
198.51.100.2/32 on the loopback device, pods get 198.18.0.0/24 on a bridge, and
Services 198.19.0.0/24. Pods have routes to the Service range and the node only,
and nothing is masqueraded to the outside: they talk to each other, to the API
server and to the host.

`down` removes every piece of host state `up` made (processes, mounts, the
bridge, iptables rules, the node address, ip_forward), so `up` works again.
Use `e2e/cluster up|down|status`, or the `real_node` pytest fixture.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client
from kubernetes import config as kubernetes_config
from kubernetes.client.exceptions import ApiException

from e2e.binaries import cache_root, locate_binaries, read_versions
from e2e.certificates import NodeIdentity
from e2e.images import Image, build_pause_image, build_shardq_image
from e2e.kubecluster import ClusterNetwork, ControlPlane, start_control_plane, write_kubeconfig
from e2e.polling import wait_for
from tests.support.ports import free_port

NODE = NodeIdentity(name="shardq-node", ip="198.51.100.2")
POD_CIDR = "198.18.0.0/24"
POD_GATEWAY = "198.18.0.1"
SERVICE_CIDR = "198.19.0.0/24"
KUBERNETES_SERVICE_IP = "198.19.0.1"
DNS_SERVICE_IP = "198.19.0.10"
CLUSTER_DOMAIN = "cluster.local"
BRIDGE = "shardq0"
CNI_NETWORK = "shardq-pods"
STORAGE_CLASS = "local"
VOLUMES = 24
DEFAULT_STATE_DIR = Path("/var/tmp/shardq-node")
STATE_DIR_ENV = "SHARDQ_NODE_DIR"
CNI_PLUGINS = Path("/usr/lib/cni")
HOST_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "debootstrap")
STOP_GRACE_S = 15.0
READY_TIMEOUT_S = 180.0


def log(message: str) -> None:
    print(f"[realnode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class NodeError(RuntimeError):
    """The node could not be brought up, or is not healthy."""


@dataclass(frozen=True)
class Layout:
    """Every path the node uses, under one state directory."""

    root: Path

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def control_plane(self) -> Path:
        return self.root / "control-plane"

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def runc_root(self) -> Path:
        return self.containerd / "runc"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def volumes(self) -> Path:
        return self.root / "volumes"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def saved_host_state(self) -> Path:
        return self.root / "host-state.json"

    @property
    def info(self) -> Path:
        """What a test needs to use a node that is up: kubeconfig, server, images."""
        return self.root / "node.json"


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_scheduler: Path
    kube_proxy: Path
    coredns: Path


def locate_node_binaries() -> NodeBinaries:
    versions = read_versions()
    node = cache_root() / f"k8s-node-{versions['K8S_VERSION']}" / "bin"
    return NodeBinaries(
        kubelet=node / "kubelet",
        kube_scheduler=node / "kube-scheduler",
        kube_proxy=node / "kube-proxy",
        coredns=cache_root() / f"coredns-{versions['COREDNS_VERSION']}" / "bin" / "coredns",
    )


@dataclass(frozen=True)
class NodeInfo:
    """A cluster the tests use: the real node as `up` leaves it, or any existing
    cluster given by its kubeconfig (`pytest e2e --cluster=kubeconfig:PATH`)."""

    kubeconfig: Path
    shardq_image: str
    kubectl: Path

    def api_client(self) -> client.ApiClient:
        api: client.ApiClient = kubernetes_config.new_client_from_config(config_file=str(self.kubeconfig))
        return api

    @property
    def server(self) -> str:
        with self.api_client() as api:
            host: str = api.configuration.host
        return host

    def kubectl_command(self, *args: str) -> list[str]:
        return [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({key: str(value) for key, value in self.__dict__.items()}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> NodeInfo:
        data = json.loads(path.read_text())
        return cls(
            kubeconfig=Path(data["kubeconfig"]), shardq_image=data["shardq_image"], kubectl=Path(data["kubectl"])
        )


# -- host commands --------------------------------------------------------------


def run(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")
    if not quiet and result.returncode != 0:
        log(f"(ignored) {' '.join(args)}: {result.stderr.strip()}")
    return result


def check_host() -> None:
    missing = [tool for tool in ("containerd", "runc", "ctr", "iptables", "ip") if shutil.which(tool) is None]
    if missing or not (CNI_PLUGINS / "bridge").exists():
        raise NodeError(
            f"missing {missing or ['CNI plugins in ' + str(CNI_PLUGINS)]}: "
            f"apt-get install --no-install-recommends {' '.join(HOST_PACKAGES)}"
        )
    if os.geteuid() != 0:
        raise NodeError("the real node needs root (containers, mounts, iptables)")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- up -------------------------------------------------------------------------


def up(layout: Layout | None = None) -> NodeInfo:
    """Bring the whole node up (tearing down leftovers of an earlier run first)."""
    layout = layout or Layout(state_dir())
    check_host()
    binaries = locate_binaries()
    node_binaries = locate_node_binaries()
    for path in (*binaries.__dict__.values(), *node_binaries.__dict__.values()):
        if isinstance(path, Path) and not os.access(path, os.X_OK):
            raise NodeError(f"missing binary {path}: run e2e/controlplane/build.sh")
    started = time.monotonic()
    if layout.root.exists():
        down(layout)
    layout.root.mkdir(parents=True)
    for directory in (layout.logs, layout.pids):
        directory.mkdir()
    log("building (or reusing) the images")
    pause, shardq = build_pause_image(), build_shardq_image()
    try:
        _configure_host(layout)
        _start_containerd(layout, pause)
        _import_images(layout, (pause, shardq))
        plane = start_control_plane(
            binaries,
            workdir=layout.control_plane,
            network=ClusterNetwork(node=NODE, service_cidr=SERVICE_CIDR, kubernetes_service_ip=KUBERNETES_SERVICE_IP),
            pid_dir=layout.pids,
            startup_timeout=READY_TIMEOUT_S,
        )
        plane.forget_detached_processes()
        log(f"control plane serving on {plane.server}")
        info = NodeInfo(kubeconfig=plane.kubeconfig, shardq_image=shardq.name, kubectl=binaries.kubectl)
        _start_node_processes(layout, plane, node_binaries)
        with info.api_client() as api:
            _wait_node_ready(api)
            _create_cluster_objects(api, layout)
            _wait_dns(plane)
        info.save(layout.info)
    except BaseException:
        log("up failed: tearing down what was started")
        with contextlib.suppress(Exception):
            down(layout, keep_logs=True)
        raise
    log(f"node ready in {time.monotonic() - started:.1f}s")
    return info


def _configure_host(layout: Layout) -> None:
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    layout.saved_host_state.write_text(json.dumps({"ip_forward": forward.read_text().strip()}))
    # The host routes between the pod bridge and its own addresses (Services, DNS, API).
    forward.write_text("1\n")
    bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if bridge_nf.exists():
        bridge_nf.write_text("1\n")
    run("ip", "addr", "add", f"{NODE.ip}/32", "dev", "lo")
    layout.cni_ipam.mkdir(parents=True)
    conflist = {
        "cniVersion": "0.4.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                # No masquerading: nothing leaves this machine from a pod.
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(layout.cni_ipam),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                    # No default route: the Service range and the node, nothing else.
                    "routes": [{"dst": SERVICE_CIDR}, {"dst": f"{NODE.ip}/32"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    _write(layout.cni_conf / "10-shardq.conflist", json.dumps(conflist, indent=2))


def _start_containerd(layout: Layout, pause: Image) -> None:
    c = layout.containerd
    config = f"""version = 2
root = "{c / "root"}"
state = "{c / "state"}"
[grpc]
  address = "{layout.containerd_socket}"
[ttrpc]
  address = "{c / "containerd.sock.ttrpc"}"
[debug]
  level = "warn"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause.name}"
  # This machine's root lacks CAP_SYS_RESOURCE: without this, every sandbox fails
  # with "can't get final child's PID from pipe" (see ../shared/notes/real-node.md).
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{layout.runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{layout.cni_conf}"
"""
    path = _write(c / "config.toml", config)
    _spawn_detached(layout, "containerd", ["containerd", "--config", str(path)])
    wait_for(
        lambda: run(*_ctr(layout), "version", check=False, quiet=True).returncode == 0,
        timeout=30,
        what="containerd to answer",
        interval=0.2,
    )


def _ctr(layout: Layout) -> list[str]:
    return ["ctr", "--address", str(layout.containerd_socket), "--namespace", "k8s.io"]


def _import_images(layout: Layout, images: tuple[Image, ...]) -> None:
    for image in images:
        started = time.monotonic()
        run(*_ctr(layout), "images", "import", "--no-unpack", str(image.archive))
        log(f"imported {image.name} in {time.monotonic() - started:.1f}s")


def refresh_shardq_image(layout: Layout | None = None) -> NodeInfo:
    """A running node gets the image of the code as it is now (built if the wheel set
    changed, else reused) imported into its containerd; its info names that image. Without
    this, tests on a node brought up earlier would run the code of that earlier time."""
    layout = layout or Layout(state_dir())
    info = NodeInfo.load(layout.info)
    shardq = build_shardq_image()
    if shardq.name != info.shardq_image:
        log(f"importing {shardq.name} (the node had {info.shardq_image})")
        _import_images(layout, (shardq,))
        info = dataclasses.replace(info, shardq_image=shardq.name)
        info.save(layout.info)
    return info


def _spawn_detached(layout: Layout, name: str, args: list[str]) -> int:
    """A process that outlives this Python process; its PID goes into the pid dir."""
    with (layout.logs / f"{name}.log").open("ab") as log_file:
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    order = len(list(layout.pids.glob("*.pid")))
    (layout.pids / f"{order:02d}-{name}.pid").write_text(f"{process.pid}\n")
    # Popen warns when collected while its child runs; the PID file tracks it from now on.
    process.returncode = 0
    return process.pid


def _start_node_processes(layout: Layout, plane: ControlPlane, node_binaries: NodeBinaries) -> None:
    pki = plane.pki
    assert pki.node is not None
    kubelet_kubeconfig = layout.kubelet / "kubelet.kubeconfig"
    layout.kubelet.mkdir(parents=True, exist_ok=True)
    write_kubeconfig(
        kubelet_kubeconfig,
        server=plane.server,
        ca=pki.ca.cert,
        user=f"system:node:{NODE.name}",
        identity=pki.node.kubelet_client,
    )
    empty_resolv_conf = _write(layout.kubelet / "resolv.conf", "")
    kubelet_config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE.ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": free_port(),
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        # This machine has cgroup v1 (hybrid); kubelet 1.35 refuses it otherwise.
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "authentication": {
            "x509": {"clientCAFile": str(pki.ca.cert)},
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "tlsCertFile": str(pki.node.kubelet_serving.cert),
        "tlsPrivateKeyFile": str(pki.node.kubelet_serving.key),
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # Pods get the cluster's DNS only, not the host's search domains and resolvers.
        "resolvConf": str(empty_resolv_conf),
        "podLogsDir": str(layout.root / "pod-logs"),
        # Our images come from no registry: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "serializeImagePulls": False,
        "maxPods": 60,
    }
    config_path = _write(layout.kubelet / "config.json", json.dumps(kubelet_config, indent=2))
    _spawn_detached(
        layout,
        "kubelet",
        [
            str(node_binaries.kubelet),
            f"--config={config_path}",
            f"--kubeconfig={kubelet_kubeconfig}",
            f"--root-dir={layout.kubelet / 'root'}",
            f"--hostname-override={NODE.name}",
            f"--node-ip={NODE.ip}",
            "--v=1",
        ],
    )
    scheduler_kubeconfig = layout.control_plane / "scheduler.kubeconfig"
    write_kubeconfig(
        scheduler_kubeconfig,
        server=plane.server,
        ca=pki.ca.cert,
        user="system:kube-scheduler",
        identity=pki.node.scheduler,
    )
    _spawn_detached(
        layout,
        "kube-scheduler",
        [
            str(node_binaries.kube_scheduler),
            f"--kubeconfig={scheduler_kubeconfig}",
            f"--authentication-kubeconfig={scheduler_kubeconfig}",
            f"--authorization-kubeconfig={scheduler_kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--v=1",
        ],
    )
    proxy_kubeconfig = layout.control_plane / "kube-proxy.kubeconfig"
    write_kubeconfig(
        proxy_kubeconfig, server=plane.server, ca=pki.ca.cert, user="system:kube-proxy", identity=pki.node.kube_proxy
    )
    _spawn_detached(
        layout,
        "kube-proxy",
        [
            str(node_binaries.kube_proxy),
            f"--kubeconfig={proxy_kubeconfig}",
            "--proxy-mode=iptables",
            f"--cluster-cidr={POD_CIDR}",
            f"--hostname-override={NODE.name}",
            f"--bind-address={NODE.ip}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--healthz-bind-address=127.0.0.1:{free_port()}",
            # Raising the host's conntrack table size is not this node's business.
            "--conntrack-max-per-core=0",
            "--v=1",
        ],
    )
    corefile = f""".:53 {{
    bind {NODE.ip}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {plane.kubeconfig} shardq-e2e
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
    corefile_path = _write(layout.root / "coredns" / "Corefile", corefile)
    _spawn_detached(layout, "coredns", [str(node_binaries.coredns), "-conf", str(corefile_path)])


def _wait_node_ready(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)

    def ready() -> bool:
        node = core.read_node(NODE.name)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    wait_for(ready, timeout=READY_TIMEOUT_S, what=f"node {NODE.name} Ready", interval=0.5, retry_on=(ApiException,))
    log(f"node {NODE.name} Ready")


def _create_cluster_objects(api: client.ApiClient, layout: Layout) -> None:
    core = client.CoreV1Api(api)
    # DNS at a Service address, as in any cluster: kube-proxy sends it to CoreDNS
    # on the node (a selector-less Service with its endpoints written here).
    dns_ports = [
        client.V1ServicePort(name="dns", port=53, protocol="UDP", target_port=53),
        client.V1ServicePort(name="dns-tcp", port=53, protocol="TCP", target_port=53),
    ]
    core.create_namespaced_service(
        "kube-system",
        client.V1Service(
            metadata=client.V1ObjectMeta(name="kube-dns", labels={"k8s-app": "kube-dns"}),
            spec=client.V1ServiceSpec(cluster_ip=DNS_SERVICE_IP, ports=dns_ports),
        ),
    )
    discovery = client.DiscoveryV1Api(api)
    discovery.create_namespaced_endpoint_slice(
        "kube-system",
        client.V1EndpointSlice(
            metadata=client.V1ObjectMeta(
                name="kube-dns-node",
                labels={
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "shardq.e2e.realnode",
                },
            ),
            address_type="IPv4",
            endpoints=[client.V1Endpoint(addresses=[NODE.ip], conditions=client.V1EndpointConditions(ready=True))],
            ports=[
                client.DiscoveryV1EndpointPort(name="dns", port=53, protocol="UDP"),
                client.DiscoveryV1EndpointPort(name="dns-tcp", port=53, protocol="TCP"),
            ],
        ),
    )
    storage = client.StorageV1Api(api)
    storage.create_storage_class(
        client.V1StorageClass(
            metadata=client.V1ObjectMeta(
                name=STORAGE_CLASS, annotations={"storageclass.kubernetes.io/is-default-class": "true"}
            ),
            provisioner="kubernetes.io/no-provisioner",
            volume_binding_mode="WaitForFirstConsumer",
            reclaim_policy="Retain",
        )
    )
    for number in range(VOLUMES):
        _create_volume(core, layout, number)


def _volume_name(number: int) -> str:
    return f"local-{number:02d}"


def _create_volume(core: client.CoreV1Api, layout: Layout, number: int) -> None:
    path = layout.volumes / _volume_name(number)
    path.mkdir(parents=True, exist_ok=True)
    core.create_persistent_volume(
        client.V1PersistentVolume(
            metadata=client.V1ObjectMeta(name=_volume_name(number), labels={"shardq.e2e/volume": "local"}),
            spec=client.V1PersistentVolumeSpec(
                capacity={"storage": "1Gi"},
                access_modes=["ReadWriteOnce"],
                persistent_volume_reclaim_policy="Retain",
                storage_class_name=STORAGE_CLASS,
                local=client.V1LocalVolumeSource(path=str(path)),
                node_affinity=client.V1VolumeNodeAffinity(
                    required=client.V1NodeSelector(
                        node_selector_terms=[
                            client.V1NodeSelectorTerm(
                                match_expressions=[
                                    client.V1NodeSelectorRequirement(
                                        key="kubernetes.io/hostname", operator="In", values=[NODE.name]
                                    )
                                ]
                            )
                        ]
                    )
                ),
            ),
        )
    )


def recycle_released_volumes(api: client.ApiClient, layout: Layout | None = None) -> int:
    """Make volumes whose claims were deleted usable again (wiped), as a provisioner would."""
    layout = layout or Layout(state_dir())
    core = client.CoreV1Api(api)
    recycled = 0
    for volume in core.list_persistent_volume(label_selector="shardq.e2e/volume=local").items:
        if volume.status.phase != "Released":
            continue
        path = Path(volume.spec.local.path)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        core.delete_persistent_volume(volume.metadata.name)
        wait_for(
            lambda name=volume.metadata.name: _absent(core, name),
            timeout=30,
            what=f"volume {volume.metadata.name} deleted",
            interval=0.2,
        )
        _create_volume(core, layout, int(volume.metadata.name.rsplit("-", 1)[1]))
        recycled += 1
    return recycled


def _absent(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_persistent_volume(name)
    except ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


def dns_query(server: str, name: str, *, timeout: float = 2.0) -> list[str]:
    """The A records a DNS server returns for `name` (a minimal client: one UDP query)."""
    query_id = os.getpid() & 0xFFFF
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.rstrip(".").split(".")) + b"\0"
    packet = struct.pack(">HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(packet, (server, 53))
        reply, _ = sock.recvfrom(4096)
    answers = struct.unpack(">H", reply[6:8])[0]
    offset = 12 + len(question) + 4
    addresses = []
    for _ in range(answers):
        if reply[offset] & 0xC0 == 0xC0:
            offset += 2
        else:
            while reply[offset]:
                offset += reply[offset] + 1
            offset += 1
        record_type, _, _, length = struct.unpack(">HHIH", reply[offset : offset + 10])
        offset += 10
        if record_type == 1:
            addresses.append(socket.inet_ntoa(reply[offset : offset + length]))
        offset += length
    return addresses


def _wait_dns(plane: ControlPlane) -> None:
    wanted = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"
    wait_for(
        lambda: dns_query(DNS_SERVICE_IP, wanted) == [KUBERNETES_SERVICE_IP],
        timeout=READY_TIMEOUT_S,
        what=f"{wanted} to resolve through the kube-dns Service",
        interval=0.5,
        retry_on=(OSError,),
    )
    log(f"DNS answers at {DNS_SERVICE_IP}")


# -- down -----------------------------------------------------------------------


def _pid_files(layout: Layout) -> list[Path]:
    return sorted(layout.pids.glob("*.pid")) if layout.pids.exists() else []


def _stop_pid(pid: int, name: str) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    log(f"{name} (pid {pid}) ignored SIGTERM for {STOP_GRACE_S:g}s: SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    if state == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def _processes_mentioning(text: str) -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            yield int(entry.name)


def _mounts_under(root: Path) -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4].replace("\\040", " ")
        if mount_point == str(root) or mount_point.startswith(str(root) + "/"):
            mounts.append(mount_point)
    return mounts


def _iptables_saved(tool: str) -> str:
    """`{tool}-save`'s rules; none on a host without iptables yet (before the node's packages)."""
    if shutil.which(f"{tool}-save") is None:
        return ""
    return run(f"{tool}-save", check=False, quiet=True).stdout


def _iptables_rules_of_ours(tool: str) -> list[str]:
    return [line for line in _iptables_saved(tool).splitlines() if re.search(r"KUBE-|CNI-|" + CNI_NETWORK, line)]


def _drop_iptables_rules(tool: str) -> None:
    """Remove every KUBE-* and CNI-* chain and the rules that jump to them."""
    saved = _iptables_saved(tool)
    if not re.search(r"KUBE-|CNI-", saved):
        return
    kept = [line for line in saved.splitlines() if not re.search(r"KUBE-|CNI-|" + CNI_NETWORK, line)]
    subprocess.run([f"{tool}-restore"], input="\n".join(kept) + "\n", text=True, check=True)


def down(layout: Layout | None = None, *, keep_logs: bool = False) -> None:
    """Stop everything `up` started and remove the host state it made."""
    layout = layout or Layout(state_dir())
    started = time.monotonic()
    # Node and control-plane processes, newest first (containerd, the oldest, last).
    pid_files = _pid_files(layout)
    containerd_pid = None
    for pid_file in reversed(pid_files):
        name = pid_file.stem.split("-", 1)[1]
        pid = int(pid_file.read_text())
        if name == "containerd":
            containerd_pid = pid
            continue
        _stop_pid(pid, name)
    # Containers the kubelet left: runc knows them all under our root.
    runc_root = layout.runc_root / "k8s.io"
    if runc_root.exists():
        listed = run("runc", "--root", str(runc_root), "list", "-q", check=False, quiet=True).stdout.split()
        for container in listed:
            run("runc", "--root", str(runc_root), "delete", "--force", container, check=False, quiet=True)
    for pid in _processes_mentioning(str(layout.containerd_socket)):  # the shims
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if containerd_pid is not None:
        _stop_pid(containerd_pid, "containerd")
    for pid_file in pid_files:
        pid_file.unlink()
    # Mounts (overlay snapshots, pod volumes, network namespaces), deepest first.
    for mount_point in sorted(_mounts_under(layout.root), key=len, reverse=True):
        run("umount", "-l", mount_point, check=False, quiet=True)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run("ip", "link", "delete", BRIDGE, check=False)
    run("ip", "addr", "del", f"{NODE.ip}/32", "dev", "lo", check=False, quiet=True)
    for tool in ("iptables", "ip6tables"):
        _drop_iptables_rules(tool)
    if layout.saved_host_state.exists():
        saved = json.loads(layout.saved_host_state.read_text())
        Path("/proc/sys/net/ipv4/ip_forward").write_text(saved["ip_forward"] + "\n")
    for result in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*"):
        result.unlink()
    if layout.root.exists():
        if keep_logs:
            kept = layout.root.with_name(layout.root.name + ".failed-logs")
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(
                layout.root, kept, ignore=shutil.ignore_patterns("root", "volumes", "images"), symlinks=True
            )
            log(f"logs kept in {kept}")
        shutil.rmtree(layout.root, ignore_errors=True)
    log(f"down in {time.monotonic() - started:.1f}s")


# -- status ---------------------------------------------------------------------


@dataclass(frozen=True)
class Leftovers:
    """Host state that exists only while a node is up; all empty after `down`."""

    processes: list[int]
    mounts: list[str]
    bridge: bool
    iptables_rules: list[str]
    node_address: bool

    @property
    def clean(self) -> bool:
        return not (self.processes or self.mounts or self.bridge or self.iptables_rules or self.node_address)


def leftovers(layout: Layout | None = None) -> Leftovers:
    layout = layout or Layout(state_dir())
    processes = [pid for pid in _processes_mentioning(str(layout.root)) if _alive(pid)]
    addresses = run("ip", "-o", "addr", "show", "dev", "lo", check=False, quiet=True).stdout
    return Leftovers(
        processes=processes,
        mounts=_mounts_under(layout.root),
        bridge=Path(f"/sys/class/net/{BRIDGE}").exists(),
        iptables_rules=_iptables_rules_of_ours("iptables") + _iptables_rules_of_ours("ip6tables"),
        node_address=f"{NODE.ip}/32" in addresses,
    )


def status(layout: Layout | None = None) -> tuple[bool, str]:
    """Whether the node is up and healthy, and a line saying so."""
    layout = layout or Layout(state_dir())
    if not layout.info.exists():
        remains = leftovers(layout)
        return False, "down" + ("" if remains.clean else f" (leftovers: {remains})")
    dead = [
        f"{pid_file.stem.split('-', 1)[1]} (pid {pid_file.read_text().strip()})"
        for pid_file in _pid_files(layout)
        if not _alive(int(pid_file.read_text()))
    ]
    if dead:
        return False, f"unhealthy: exited {', '.join(dead)}"
    info = NodeInfo.load(layout.info)
    try:
        with info.api_client() as api:
            server = api.configuration.host
            node = client.CoreV1Api(api).read_node(NODE.name)
    except Exception as error:  # any failure to answer means not usable
        return False, f"unhealthy: API server of {info.kubeconfig}: {error}"
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    if not ready:
        return False, f"unhealthy: node {NODE.name} not Ready"
    return True, f"up: {server}, node {NODE.name} Ready, kubeconfig {info.kubeconfig}, image {info.shardq_image}"


class RunningNode:
    """The cluster a test session uses: this machine's real node (`layout` set, so
    `restart` can bring it down and up again), or an existing cluster (`layout`
    None: tests of the node's own host state skip)."""

    def __init__(self, layout: Layout | None, info: NodeInfo) -> None:
        self.layout = layout
        self.info = info

    def own_node(self, needed_for: str) -> Layout:
        """The real node's layout; skips the calling test on an existing cluster."""
        if self.layout is None:
            import pytest

            pytest.skip(f"needs this machine's real node ({needed_for}), not an existing cluster")
        return self.layout

    def restart(self) -> Leftovers:
        """Down, then up again; returns what `down` left behind (nothing, if it works)."""
        layout = self.own_node("to bring it down and up")
        down(layout)
        remains = leftovers(layout)
        self.info = up(layout)
        return remains


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster", description="The real single-node Kubernetes of the tests.")
    parser.add_argument(
        "command", choices=("up", "down", "status", "image"), help="image: import the current code's image into it"
    )
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "up":
            info = up()
            print(f"export KUBECONFIG={info.kubeconfig}")
            return 0
        if arguments.command == "down":
            down()
            remains = leftovers()
            if not remains.clean:
                print(f"left behind: {remains}", file=sys.stderr)
                return 1
            return 0
        if arguments.command == "image":
            print(refresh_shardq_image().shardq_image)
            return 0
        healthy, line = status()
        print(line)
        return 0 if healthy else 1
    except NodeError as error:
        print(f"e2e/cluster {arguments.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
