"""`shardq serve`: contributed to the shardq CLI through the `shardq.cli` entry point."""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click
import yaml

from shard_server.logs import configure_logging
from shard_server.runtime.client_access import OPEN_ACCESS, ClientAccess, ReviewedAccess
from shard_server.runtime.idle_polling import check_window, cpus_to_spin_on
from shard_server.runtime.serving_tls import TlsFiles, check_tls_files
from shard_server.server import ServerSettings, serve
from shardq import event_loops
from shardq.coordination.cluster_map import cluster_map_from_text, read_cluster_map
from shardq.coordination.leases import LeaseStore
from shardq.coordination.peer_credentials import NO_PEER_SECRET, read_peer_secret
from shardq.durations import parse_duration_ms
from shardq.errors import InvalidArgument

if TYPE_CHECKING:
    from shard_server.runtime.kubernetes_reviews import KubernetesReviews
    from shardq.coordination.kubernetes_maps import ConfigMapSource
from shardq.queues import QueueConfig, parse_queue_option, queue_config_from_spec
from shardq.sizes import NotASize, parse_size

log = logging.getLogger(__name__)


def load_queue_file(path: pathlib.Path) -> list[QueueConfig]:
    """queues.yaml: `queues: {name: {spec as in a Queue resource}}` or a list of {name, ...}."""
    text = path.read_bytes()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: {describe_yaml_error(error, text)}") from None
    entries = data.get("queues", data) if isinstance(data, dict) else data
    if isinstance(entries, dict):
        return [queue_config_from_spec(str(name), spec or {}) for name, spec in entries.items()]
    if isinstance(entries, list):
        configs = []
        for item in entries:
            if not isinstance(item, dict) or "name" not in item:
                raise ValueError(f"{path}: every queue needs a name")
            spec = {k: v for k, v in item.items() if k != "name"}
            configs.append(queue_config_from_spec(str(item["name"]), spec))
        return configs
    raise ValueError(f"{path}: expected a mapping of queue names or a list of queues")


def describe_yaml_error(error: yaml.YAMLError, text: bytes) -> str:
    """One line where PyYAML writes several: what is wrong, at which line and column."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}{context}"
    if isinstance(error, yaml.reader.ReaderError) and isinstance(error.character, int):
        # PyYAML gives only an offset: in bytes for bytes that do not decode, in characters
        # for a character YAML does not allow.
        decoded = text.decode("utf-8", "replace")
        allowed = error.encoding == "unicode"
        offset = error.position if allowed else len(text[: error.position].decode("utf-8", "replace"))
        line = decoded.count("\n", 0, offset) + 1
        column = offset - decoded.rfind("\n", 0, offset)
        what = f"character {chr(error.character)!r}" if allowed else f"byte 0x{error.character:02x}"
        return f"not valid YAML at line {line}, column {column}: {what} ({error.reason})"
    return "not valid YAML: " + " ".join(str(error).split())


class ByteSize(click.ParamType[int]):
    """A number of bytes, whole or with a binary unit: 1048576, 256MiB, 1.5GiB (read as queue
    settings' sizes are, by shardq.sizes; a fraction of a byte is dropped)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(str(value))
        except NotASize:
            self.fail(f"{value!r} is not a size: use e.g. 256MiB, 64GiB or a number of bytes", param, ctx)
        except ValueError as error:
            self.fail(str(error), param, ctx)
        if size < 1:
            self.fail(f"{value!r} is not a size of at least 1 byte", param, ctx)
        return int(size)


@click.command("serve")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False, path_type=pathlib.Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7600, show_default=True, type=int)
@click.option("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
@click.option("--queue", "queue_specs", multiple=True, help="name[:shards=4,fifo=true,visibility=30s,...]")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=pathlib.Path))
@click.option("--map-size", type=ByteSize(), default="64GiB", show_default=True, help="LMDB map size per shard")
@click.option(
    "--writer-threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="threads running the shards' write transactions; raise it when fsync is slow (network disks)",
)
@click.option(
    "--commit-ahead/--no-commit-ahead",
    default=True,
    show_default=True,
    help="answer a standalone shard's writes once their log entry is durable in one write, "
    "before LMDB's two-step commit (recovered on restart if that commit never finished)",
)
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True)
@click.option(
    "--event-loop",
    type=click.Choice(event_loops.CHOICES),
    default=event_loops.AUTO,
    show_default=True,
    help="the asyncio loop serving calls: uvloop (auto: when installed) takes about a third off gRPC's per-call cost",
)
@click.option(
    "--cluster-file",
    type=click.Path(exists=True, dir_okay=False, path_type=pathlib.Path),
    help="cluster mode: servers, queues and replica placement (JSON)",
)
@click.option("--server-id", default="", help="cluster mode: this server's id in the cluster file")
@click.option(
    "--lease-store",
    default=None,
    help="cluster mode: the lease directory shared by a local cluster's servers, or `kubernetes` for Lease objects",
)
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="with --lease-store kubernetes: the API server to use (default: the pod's service account)",
)
@click.option(
    "--namespace",
    default=None,
    help="with --lease-store kubernetes: the Leases' namespace (default: the pod's own namespace)",
)
@click.option(
    "--lease-watch/--no-lease-watch",
    default=True,
    show_default=True,
    help="with --lease-store kubernetes: read Leases from one watch (the default) or with a GET per read",
)
@click.option(
    "--cluster-configmap",
    default=None,
    help="with --lease-store kubernetes: follow the cluster map in this ConfigMap (key cluster.json) instead of a file",
)
@click.option(
    "--sync-before-ready",
    default="120s",
    show_default=True,
    help="cluster mode: report ready (gRPC health) only once every replica here is in sync, "
    "or after this long at most; 0 reports ready at once",
)
@click.option(
    "--queues-managed-by",
    default=None,
    help='refuse runtime queue changes, naming where queues are defined (e.g. "Queue resources in namespace x")',
)
@click.option(
    "--idle-poll",
    default="0",
    show_default=True,
    help="keep this machine's CPUs from going idle for this long after each answer (e.g. 2ms; 0: off), "
    "with idle-priority spinners: lower latency at few calls in flight on VMs where waking an idle CPU is "
    "slow, paid for in CPU time (see README, idle polling)",
)
@click.option(
    "--peer-secret-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="the cluster's shared secret (at least 32 printable characters): replication calls and calls marked as "
    "forwarded are taken only with it, and this server's calls to its peers carry it",
)
@click.option(
    "--client-auth",
    type=click.Choice(["none", "kubernetes"]),
    default="none",
    show_default=True,
    help="kubernetes: every client call must carry a ServiceAccount token ('authorization: Bearer …'), reviewed "
    "by the API server (TokenReview), and a right to its verb on the queue (SubjectAccessReview on shardq.io "
    "queues: send, receive, get, list, admin, export); needs --peer-secret-file in a cluster",
)
@click.option(
    "--token-audience",
    default="shardq",
    show_default=True,
    help="with --client-auth kubernetes: the audience clients' tokens must be issued for",
)
@click.option(
    "--tls-cert-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="serve TLS on the gRPC and metrics ports with this PEM certificate (chain); read again when it changes",
)
@click.option(
    "--tls-key-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="the private key of --tls-cert-file (PEM)",
)
@click.option(
    "--tls-ca-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="with --tls-cert-file: the CA certificates (PEM) this server checks its peers' certificates against "
    "(default: the system's trusted roots)",
)
@click.option(
    "--health-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="also serve grpc.health.v1 alone, in plaintext, on this port: for probes that cannot speak TLS "
    "(the kubelet's gRPC probe)",
)
@click.option(
    "--idle-poll-cpus",
    type=click.IntRange(min=1),
    default=None,
    help="with --idle-poll: spin on this many CPUs (default: every CPU the server may run on); keep it "
    "below a container's CPU limit",
)
def serve_command(
    data_dir: pathlib.Path,
    host: str,
    port: int,
    metrics_port: int | None,
    queue_specs: tuple[str, ...],
    config_file: pathlib.Path | None,
    map_size: int,
    writer_threads: int,
    commit_ahead: bool,
    log_format: str,
    event_loop: str,
    cluster_file: pathlib.Path | None,
    server_id: str,
    lease_store: str | None,
    kubeconfig: pathlib.Path | None,
    namespace: str | None,
    lease_watch: bool,
    cluster_configmap: str | None,
    sync_before_ready: str,
    queues_managed_by: str | None,
    idle_poll: str,
    idle_poll_cpus: int | None,
    peer_secret_file: pathlib.Path | None,
    client_auth: str,
    token_audience: str,
    tls_cert_file: pathlib.Path | None,
    tls_key_file: pathlib.Path | None,
    tls_ca_file: pathlib.Path | None,
    health_port: int | None,
) -> None:
    """Run a shard server hosting the given queues (or its replicas of a cluster's queues)."""
    cluster = None
    try:
        configs = [parse_queue_option(spec) for spec in queue_specs]
        if config_file is not None:
            configs += load_queue_file(config_file)
        if cluster_file is not None:
            cluster = read_cluster_map(cluster_file)
            configs += cluster.queue_configs()
        loop = event_loops.resolve(event_loop)
        try:
            sync_before_ready_ms = parse_duration_ms(sync_before_ready)
        except ValueError as error:
            raise ValueError(f"--sync-before-ready: {error}") from None
        try:
            idle_poll_ms = parse_duration_ms(idle_poll)
            if idle_poll_ms:
                check_window(idle_poll_ms)
        except ValueError as error:
            raise ValueError(f"--idle-poll: {error}") from None
        if idle_poll_ms:
            cpus_to_spin_on(idle_poll_cpus)  # no Linux, or more CPUs than this server may use: said now
        elif idle_poll_cpus is not None:
            raise ValueError("--idle-poll-cpus goes with --idle-poll")
        credential = NO_PEER_SECRET if peer_secret_file is None else read_peer_secret(peer_secret_file)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    tls = serving_tls_files(tls_cert_file, tls_key_file, tls_ca_file)
    if cluster is not None and (not server_id or lease_store is None):
        raise click.UsageError("--cluster-file needs --server-id and --lease-store")
    uses_kubernetes = KUBERNETES in (lease_store, client_auth)
    if not uses_kubernetes and (kubeconfig is not None or namespace is not None):
        raise click.UsageError(
            "--kubeconfig and --namespace go with --lease-store kubernetes or --client-auth kubernetes"
        )
    if lease_store != KUBERNETES and cluster_configmap:
        raise click.UsageError("--cluster-configmap goes with --lease-store kubernetes")
    if client_auth != KUBERNETES and token_audience != "shardq":
        raise click.UsageError("--token-audience goes with --client-auth kubernetes")
    access: ClientAccess = OPEN_ACCESS
    reviews = None
    if client_auth == KUBERNETES:
        if not token_audience.strip() or any(c.isspace() for c in token_audience):
            raise click.UsageError("--token-audience: give one audience, without spaces")
        try:
            reviews = kubernetes_reviews(kubeconfig=kubeconfig, namespace=namespace, audience=token_audience)
        except (OSError, ValueError) as error:
            raise click.ClickException(f"--client-auth kubernetes: {error}") from None
        access = ReviewedAccess(reviews)
    source = None
    if cluster_configmap is not None:
        if cluster_file is not None:
            raise click.UsageError("give --cluster-file or --cluster-configmap, not both")
        try:
            source = config_map_source(cluster_configmap, kubeconfig=kubeconfig, namespace=namespace)
            cluster = cluster_map_from_text(source.read_text())
        except (OSError, ValueError) as error:
            raise click.ClickException(f"cannot read the cluster map: {error}") from None
        configs += cluster.queue_configs()
        if not server_id:
            raise click.UsageError("--cluster-configmap needs --server-id")
    configure_logging(json_lines=log_format == "json")
    if reviews is not None:
        # Said once here; each refused client is told too (UNAVAILABLE, naming the rights).
        for missing in reviews.missing_rights():
            log.warning("--client-auth kubernetes: clients will be refused until this is fixed: %s", missing)
    with contextlib.ExitStack() as closing:
        leases = None
        if cluster is not None and lease_store is not None:
            try:
                leases = closing.enter_context(
                    open_lease_store(lease_store, kubeconfig=kubeconfig, namespace=namespace, watch=lease_watch)
                )
            except (OSError, ValueError) as error:
                raise click.ClickException(f"cannot open the lease store {lease_store!r}: {error}") from None
        settings = ServerSettings(
            data_dir=data_dir,
            queues=configs,
            host=host,
            port=port,
            metrics_port=metrics_port,
            map_size=map_size,
            writer_threads=writer_threads,
            commit_ahead=commit_ahead,
            cluster=cluster,
            cluster_file=cluster_file,
            cluster_source=source,
            server_id=server_id,
            lease_store=leases,
            queues_managed_by=queues_managed_by,
            sync_before_ready_s=sync_before_ready_ms / 1000,
            idle_poll_ms=idle_poll_ms,
            idle_poll_cpus=idle_poll_cpus,
            peer_credential=credential,
            client_access=access,
            tls=tls,
            health_port=health_port,
        )
        try:
            event_loops.run(serve(settings), choice=loop)
        except ValueError as error:
            raise click.ClickException(str(error)) from None


KUBERNETES = "kubernetes"


def serving_tls_files(cert: pathlib.Path | None, key: pathlib.Path | None, ca: pathlib.Path | None) -> TlsFiles | None:
    """The TLS files given, checked now: a pair that does not load stops the start, named."""
    if cert is None and key is None:
        if ca is not None:
            raise click.UsageError("--tls-ca-file goes with --tls-cert-file and --tls-key-file")
        return None
    if cert is None or key is None:
        raise click.UsageError("--tls-cert-file and --tls-key-file go together")
    files = TlsFiles(cert=cert, key=key, ca=ca)
    try:
        check_tls_files(files)
    except InvalidArgument as error:
        raise click.ClickException(error.message) from None
    return files


# Where a pod finds its own namespace.
SERVICE_ACCOUNT_NAMESPACE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def pod_namespace(namespace: str | None) -> str:
    if namespace is not None:
        return namespace
    if not SERVICE_ACCOUNT_NAMESPACE.exists():
        raise ValueError("--namespace is needed outside a pod")
    return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()


def config_map_source(name: str, *, kubeconfig: pathlib.Path | None, namespace: str | None) -> ConfigMapSource:
    # Imported here: only Kubernetes mode needs the client.
    from shardq.coordination.kubernetes_leases import connect
    from shardq.coordination.kubernetes_maps import ConfigMapSource

    return ConfigMapSource(connect(kubeconfig=kubeconfig), namespace=pod_namespace(namespace), name=name)


def kubernetes_reviews(*, kubeconfig: pathlib.Path | None, namespace: str | None, audience: str) -> KubernetesReviews:
    # Imported here: only Kubernetes mode needs the client.
    from shard_server.runtime.kubernetes_reviews import connect_reviews

    return connect_reviews(kubeconfig=kubeconfig, namespace=pod_namespace(namespace), audience=audience)


@contextlib.contextmanager
def open_lease_store(
    spec: str, *, kubeconfig: pathlib.Path | None, namespace: str | None, watch: bool
) -> Iterator[LeaseStore]:
    """The lease store `spec` names: `kubernetes` (Lease objects) or a local lease directory."""
    if spec != KUBERNETES:
        # Imported here, as the Kubernetes store is below: each mode needs only its own.
        from shardq.coordination.local_leases import LocalLeaseStore

        with LocalLeaseStore(pathlib.Path(spec)) as local:
            yield local
        return
    # Imported here: only Kubernetes mode needs the client.
    from shardq.coordination.kubernetes_leases import KubernetesLeaseStore, connect

    with connect(kubeconfig=kubeconfig) as api:
        store = KubernetesLeaseStore(api, namespace=pod_namespace(namespace), watch=watch)
        try:
            store.wait_until_watching(store.request_timeout_seconds)
            yield store
        finally:
            store.close()
