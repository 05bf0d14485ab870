"""Assemble and run one shard server: gRPC services, health, reflection, metrics,
background loops, and a graceful shutdown that finishes in-flight commits."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import pathlib
import signal
import socket
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shard_server import metrics
from shard_server.runtime.client_access import OPEN_ACCESS, ClientAccess
from shard_server.runtime.committing import CallsInProgress, wall_clock_ms
from shard_server.runtime.forwarding import Router
from shard_server.runtime.idle_polling import IdlePolling, cpus_to_spin_on
from shard_server.runtime.map_following import ClusterMapFile, ClusterMapFollower, MapSource
from shard_server.runtime.queue_admin import QueueAdmin, runtime_configs
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.runtime.readiness import announce_ready, report_ready_once_in_sync
from shard_server.runtime.replication.peers import PeerChannels
from shard_server.runtime.replication.replicas import Replicas
from shard_server.runtime.serving_tls import TlsFiles, serving_certificate
from shard_server.service.decoding import RejectingUndecodable
from shard_server.service.exporting import ExportServicer
from shard_server.service.observing import ObservingInterceptor
from shard_server.service.queues import QueueServicer
from shard_server.service.replication import ReplicationServicer
from shard_server.storage.lmdb_store import DEFAULT_MAP_SIZE
from shard_server.storage.queue_catalog import QueueCatalog
from shardq import event_loops, grpc_io
from shardq.api.v1 import (
    export_pb2,
    export_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
    replication_pb2,
    replication_pb2_grpc,
)
from shardq.coordination.cluster_map import ClusterMap
from shardq.coordination.leases import LeaseStore
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.metrics_http import CertificateExpiryCollector, start_metrics_server
from shardq.queues import QueueConfig
from shardq.serving_certificates import ServingCertificate

log = logging.getLogger(__name__)

MAX_GRPC_MESSAGE_BYTES = 64 * 1024 * 1024
SHUTDOWN_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    data_dir: pathlib.Path
    queues: Sequence[QueueConfig]
    host: str = "127.0.0.1"
    port: int = 7600
    metrics_port: int | None = None
    map_size: int = DEFAULT_MAP_SIZE
    # Threads running write transactions, shared by all shards (see WriterThreads).
    writer_threads: int = 1
    # Standalone shards answer writes once their entry is written ahead (see commit_ahead).
    commit_ahead: bool = True
    # Cluster mode: this server's id in the cluster map, and the lease store (local
    # file or Kubernetes Leases; the caller opens and closes it).
    cluster: ClusterMap | None = None
    # The file the map was read from: followed while the server runs, and changed by
    # runtime queue management in a local cluster.
    cluster_file: pathlib.Path | None = None
    # Where else the map is followed from (the operator's ConfigMap).
    cluster_source: MapSource | None = None
    server_id: str = ""
    lease_store: LeaseStore | None = None
    # Where the queues are defined when the server must not change them itself (a
    # cluster map, the operator's Queue resources); runtime queue management then
    # refuses and names it.
    queues_managed_by: str | None = None
    # Cluster mode: how long a starting server waits for its replicas to be in sync
    # before it reports ready anyway (0: ready at once); see runtime.readiness.
    sync_before_ready_s: float = 120.0
    # Idle polling (runtime.idle_polling): how long after each answer this machine's
    # CPUs are kept from going idle (0: off), and on how many CPUs (None: all allowed).
    idle_poll_ms: float = 0.0
    idle_poll_cpus: int | None = None
    # What the cluster's servers present to each other (shardq.coordination.peer_credentials);
    # without a secret every caller is taken for a peer.
    peer_credential: PeerCredential = NO_PEER_SECRET
    # Who may call: every client (OPEN_ACCESS), or those the cluster authenticates and
    # authorises per queue and verb (runtime.client_access, --client-auth kubernetes).
    client_access: ClientAccess = OPEN_ACCESS
    # TLS on the gRPC and metrics ports, and to peers (runtime.serving_tls); None: plaintext.
    tls: TlsFiles | None = None
    # A plaintext port serving only grpc.health.v1, for probes that cannot speak TLS
    # (the kubelet's gRPC probe); None: none.
    health_port: int | None = None


def _can_bind(host: str, port: int) -> bool:
    if port == 0:
        return True
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            probe.bind((host, port))
    except OSError:
        return False
    return True


def _listen(server: grpc.aio.Server, host: str, port: int, option: str, tls: ServingCertificate | None) -> int:
    """Open `port` on `server` (over TLS with `tls`), or exit naming `option`."""
    address = f"{host}:{port}"
    bound = 0
    try:
        # Checked first: gRPC's own failure is a log line from its C core, then an exception.
        if _can_bind(host, port):
            bound = (
                server.add_insecure_port(address)
                if tls is None
                else server.add_secure_port(address, tls.grpc_credentials())
            )
    except RuntimeError:
        bound = 0  # newer grpc raises where older ones returned 0
    if bound == 0:
        raise SystemExit(
            f"shardq: cannot listen on {address}: the port is in use or the address is not "
            f"this machine's; choose another {option} or --host"
        )
    return bound


def _keep_cpus_awake(idle_polling: IdlePolling, calls: CallsInProgress) -> None:
    idle_polling.called(calls.count)


async def serve(settings: ServerSettings, *, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set), then shut down gracefully."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    leases = settings.lease_store
    router: Router | None = None
    peers: PeerChannels | None = None
    replicas: Replicas | None = None
    presented = None if settings.tls is None else serving_certificate(settings.tls)
    peer_tls = None if settings.tls is None else settings.tls.peer_tls()
    if settings.cluster is not None:
        if leases is None or settings.server_id not in settings.cluster.servers:
            raise SystemExit("shardq: cluster mode needs --lease-store and a --server-id listed in the cluster file")
        router = Router(
            settings.cluster, leases, server_id=settings.server_id, credential=settings.peer_credential, tls=peer_tls
        )
        router.refresh()
        peers = PeerChannels(settings.cluster, credential=settings.peer_credential, tls=peer_tls)
        if settings.peer_credential.secret is None and settings.client_access.enforced:
            # Servers forward clients' calls to leaders, which take them as a peer's: without
            # a secret, any client could mark its call forwarded and pass unauthenticated.
            raise SystemExit("shardq: --client-auth in a cluster needs --peer-secret-file")
        if settings.peer_credential.secret is None:
            log.warning("no peer secret (--peer-secret-file): any caller is taken for one of the cluster's servers")
        replicas = Replicas(server_id=settings.server_id, leases=leases, peers=peers)
    catalog = QueueCatalog(settings.data_dir)
    # Queues defined by --queue/--config; a cluster map's queues are changed through the map.
    static = {config.name for config in settings.queues}
    if settings.cluster is not None:
        static -= {queue.name for queue in settings.cluster.queues}
    managed_by = settings.queues_managed_by
    if managed_by is None and settings.cluster is not None and settings.cluster_file is None:
        managed_by = "the cluster map this server was started with"
    runtime = runtime_configs(catalog, static) if managed_by is None and settings.cluster is None else []
    host = QueueHost(
        settings.data_dir,
        [*settings.queues, *runtime],
        map_size=settings.map_size,
        writer_threads=settings.writer_threads,
        commit_ahead=settings.commit_ahead,
        cluster=settings.cluster,
        server_id=settings.server_id,
        router=router,
    )
    idle_polling = None
    on_answer = None
    if settings.idle_poll_ms > 0:
        idle_polling = IdlePolling(settings.idle_poll_ms, cpus_to_spin_on(settings.idle_poll_cpus))
        on_answer = functools.partial(_keep_cpus_awake, idle_polling, host.writers.calls)
    server = grpc.aio.server(
        interceptors=[
            ObservingInterceptor(on_answer=on_answer),
            RejectingUndecodable(),
        ],
        options=[
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    admin = QueueAdmin(host, catalog=catalog, static=static, managed_by=managed_by)
    access = settings.client_access
    queue_servicer = QueueServicer(host, admin, credential=settings.peer_credential, access=access)
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue_servicer, server)
    export_servicer = ExportServicer(host, credential=settings.peer_credential, access=access)
    export_pb2_grpc.add_ExportServiceServicer_to_server(export_servicer, server)
    service_names = [
        queue_pb2.DESCRIPTOR.services_by_name["QueueService"].full_name,
        export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    replication_servicer = None
    if settings.cluster is not None:
        # Replicas only: a standalone server has no peers, and its clients no business there.
        assert replicas is not None
        replication_servicer = ReplicationServicer(
            replicas,
            server_id=settings.server_id,
            address=f"{settings.host}:{settings.port}",
            credential=settings.peer_credential,
        )
        replication_pb2_grpc.add_ReplicationServiceServicer_to_server(replication_servicer, server)
        service_names.append(replication_pb2.DESCRIPTOR.services_by_name["ReplicationService"].full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Ready (service "", what the readiness probe asks) once the replicas are in sync;
    # the servicer starts with "" SERVING, so it is turned off before the port opens.
    gate_readiness = replicas is not None and settings.sync_before_ready_s > 0
    if gate_readiness:
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(service_names, server)
    port = _listen(server, settings.host, settings.port, "--port", presented)
    health_server = None
    if settings.health_port is not None:
        # The same servicer: this port says exactly what the main port's health says.
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        _listen(health_server, settings.host, settings.health_port, "--health-port", None)
    host.advertised_address = f"{settings.host}:{port}"
    if replication_servicer is not None:
        replication_servicer.address = host.advertised_address

    collector = metrics.ShardCollector(
        lambda: [shard.report() for _, _, shard in host.shard_stats_sources()],
        lambda: [queue.config for queue in list(host.queues.values())],
        now_ms=wall_clock_ms,
    )
    metrics.REGISTRY.register(collector)
    expiry = None
    if presented is not None:
        expiry = CertificateExpiryCollector(
            presented.expires_at,
            "When the certificate this server presents on its gRPC and metrics ports expires"
            " (its notAfter, Unix seconds). A renewed certificate counts once the server serves"
            " it: a renewal whose files do not load leaves the old date here.",
        )
        metrics.REGISTRY.register(expiry)
    metrics.record_build_info()
    metrics_server = None
    if settings.metrics_port is not None:
        try:
            metrics_server = start_metrics_server(
                settings.host,
                settings.metrics_port,
                metrics.REGISTRY,
                None if presented is None else presented.ssl_context,
            )
        except OSError as error:
            raise SystemExit(
                f"shardq: cannot serve metrics on {settings.host}:{settings.metrics_port}: {error.strerror}; "
                "choose another --metrics-port"
            ) from None

    admin.start()
    tasks: list[asyncio.Task[None]] = []
    if settings.cluster is not None:
        assert router is not None
        assert replicas is not None
        assert leases is not None
        for queue in host.queues.values():
            replicas.start_queue(queue, settings.cluster)
        tasks.append(asyncio.create_task(router.run()))
        source = settings.cluster_source or settings.cluster_file
        if source is not None:
            follower = ClusterMapFollower(
                source,
                host,
                replicas,
                open_hosted=admin.open_hosted,
                close_hosted=admin.close_hosted,
                open_shard=admin.open_shard,
                close_shard=admin.close_shard,
            )
            tasks.append(asyncio.create_task(follower.run()))
            if managed_by is None and settings.cluster_file is not None:
                # A local cluster: queue management changes the shared map.
                admin.map_file = ClusterMapFile(settings.cluster_file, leases, now_ms=wall_clock_ms)
                admin.follower = follower
    await server.start()
    if health_server is not None:
        await health_server.start()
    for name in service_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_note = f", metrics on {settings.host}:{settings.metrics_port}" if settings.metrics_port is not None else ""
    if presented is not None:
        metrics_note += f", TLS with {presented.cert}"
    if settings.health_port is not None:
        metrics_note += f", health (plaintext) on {settings.host}:{settings.health_port}"
    # The loop (`--event-loop`) is named once serving, so a start that fails says one thing only.
    log.info(
        "serving %s on %s%s, event loop %s, %s",
        ", ".join(sorted(host.queues)),
        host.advertised_address,
        metrics_note,
        event_loops.name_of(asyncio.get_running_loop()),
        grpc_io.describe(),
    )
    print(f"shardq: listening on {host.advertised_address}", file=sys.stderr, flush=True)
    if gate_readiness:
        assert replicas is not None
        tasks.append(
            asyncio.create_task(
                report_ready_once_in_sync(health_servicer, replicas.out_of_sync, within_s=settings.sync_before_ready_s)
            )
        )
    else:
        await announce_ready(health_servicer)
    if idle_polling is not None:
        idle_polling.start()
        log.info("idle polling: spinners on CPUs %s, %g ms after each answer", idle_polling.cpus, settings.idle_poll_ms)
    try:
        await stop.wait()
    finally:
        log.info("shutting down: refusing new calls, finishing in-flight ones")
        await health_servicer.enter_graceful_shutdown()
        queue_servicer.end_request_streams()
        if replicas is not None:
            # Before the server stops answering: the heirs' first appends and the clients'
            # retries find the new leaders at once rather than after a lease expiry.
            handed = await replicas.hand_off_all()
            log.info("handed leadership of %d shards to in-sync followers", handed)
        await server.stop(SHUTDOWN_GRACE_S)
        if health_server is not None:
            await health_server.stop(None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if replicas is not None:
            await replicas.stop_all("shutting down")
        await admin.stop()
        await host.close()
        if peers is not None:
            await peers.close()
        if router is not None:
            await router.close()
        metrics.REGISTRY.unregister(collector)
        if expiry is not None:
            metrics.REGISTRY.unregister(expiry)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        if idle_polling is not None:
            idle_polling.close()
        log.info("stopped")
