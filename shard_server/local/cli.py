"""`shardq local up` and `shardq local status`: contributed to the shardq CLI through the `shardq.cli` entry point."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import sys
import threading
from types import FrameType

import click

from shard_server.local.cluster_files import (
    LMDB_LEASE_FILE,
    METRICS_PORT_OFFSET,
    build_cluster_file,
    ensure_peer_secret,
    open_cluster_lease_store,
    parse_queue_argument,
    read_cluster_file,
    read_cluster_peer_secret,
    read_supervisor_record,
    remove_supervisor_record,
    write_cluster_file,
)
from shard_server.local.observing import fetch_all_replica_status
from shard_server.local.processes import (
    is_cluster_server,
    ports_taken,
    process_is_alive,
    server_log_path,
    wall_clock_ms,
)
from shard_server.local.statuses import build_cluster_status, cluster_status_to_json, format_cluster_status
from shard_server.local.supervising import Supervisor, SupervisorSettings, read_shard_leases
from shardq.coordination.cluster_map import CLUSTER_FILE, ClusterMap
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.durations import parse_duration_ms

DATA_DIR = click.Path(file_okay=False, path_type=pathlib.Path)


@click.group("local")
def local_group() -> None:
    """Run a replicated cluster of shard servers on this machine."""


@local_group.command("up")
@click.option("--data-dir", required=True, type=DATA_DIR, help="cluster file, leases, server data and logs")
@click.option("--servers", "server_count", default=3, show_default=True, type=click.IntRange(1, 64))
@click.option("--queue", "queue_args", multiple=True, help="name[:shards=4,replicas=3,fifo=true,...]")
@click.option("--base-port", default=7601, show_default=True, type=click.IntRange(1, 65535))
@click.option("--metrics-base-port", type=click.IntRange(1, 65535), default=None, help="default: base port + 2000")
@click.option("--lease-duration", default="2s", show_default=True, help="how long a shard lease lasts unrenewed")
def up_command(
    data_dir: pathlib.Path,
    server_count: int,
    queue_args: tuple[str, ...],
    base_port: int,
    metrics_base_port: int | None,
    lease_duration: str,
) -> None:
    """Start the servers and supervise them in the foreground until Ctrl-C or SIGTERM.

    A dead server is restarted, the shards it led fail over to an in-sync replica, and
    leadership moves off a server that leads much more load than the others. Run it again
    on the same --data-dir to restart the cluster with its data (the cluster file wins
    over --servers and --queue then).
    """
    _configure_logging()
    data_dir = data_dir.absolute()
    _refuse_if_supervised(data_dir)
    try:
        lease_duration_ms = parse_duration_ms(lease_duration)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--lease-duration") from None
    try:
        cluster = _load_or_create_cluster(
            data_dir,
            server_count=server_count,
            queue_args=queue_args,
            base_port=base_port,
            metrics_base_port=metrics_base_port if metrics_base_port is not None else base_port + METRICS_PORT_OFFSET,
            lease_duration_ms=lease_duration_ms,
        )
        credential = ensure_peer_secret(data_dir)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger("shard_server.local").info("%s: stopping the cluster", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    store, imported = _open_lease_store(data_dir)
    if imported:
        logging.getLogger("shard_server.local").info(
            "imported %d shard leases, with their epochs, from %s", imported, data_dir / LMDB_LEASE_FILE
        )
    with store:
        supervisor = Supervisor(
            settings=SupervisorSettings(data_dir=data_dir), cluster=cluster, store=store, credential=credential
        )

        def print_endpoints() -> None:
            for server_id, server in supervisor.servers.items():
                click.echo(
                    f"{server_id}  {server.entry.address}  pid {server.pid}  "
                    f"metrics http://{server.entry.metrics_address}/metrics  log {server_log_path(data_dir, server_id)}"
                )
            sys.stdout.flush()

        supervisor.run(stop, on_started=print_endpoints)


@local_group.command("status")
@click.option("--data-dir", required=True, type=DATA_DIR)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def status_command(data_dir: pathlib.Path, as_json: bool) -> None:
    """Per server its endpoint, pid and liveness; per shard its leader, epoch, in-sync replicas, commit index, load."""
    try:
        cluster = read_cluster_file(data_dir)
    except FileNotFoundError:
        raise click.ClickException(
            f"no cluster in {data_dir} (no {CLUSTER_FILE}); start one with `shardq local up`"
        ) from None
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    record = read_supervisor_record(data_dir)
    pids = {entry.pid for entry in record.servers.values()} if record is not None else set()
    store, _ = _open_lease_store(data_dir)
    with store:
        leases = read_shard_leases(store, cluster)
    addresses = {server_id: entry.address for server_id, entry in cluster.servers.items()}
    try:
        credential = read_cluster_peer_secret(data_dir)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    reports = fetch_all_replica_status(addresses, credential=credential)
    status = build_cluster_status(
        cluster=cluster,
        record=record,
        supervisor_alive=record is not None and process_is_alive(record.pid),
        alive_pids=frozenset(pid for pid in pids if pid and process_is_alive(pid)),
        leases=leases,
        reports=reports,
        now_ms=wall_clock_ms(),
    )
    if as_json:
        click.echo(json.dumps(cluster_status_to_json(status), sort_keys=True))
    else:
        click.echo(format_cluster_status(status))


def _load_or_create_cluster(
    data_dir: pathlib.Path,
    *,
    server_count: int,
    queue_args: tuple[str, ...],
    base_port: int,
    metrics_base_port: int,
    lease_duration_ms: int,
) -> ClusterMap:
    log = logging.getLogger("shard_server.local")
    if (data_dir / CLUSTER_FILE).exists():
        cluster = read_cluster_file(data_dir)
        log.info(
            "reusing %s: %d servers, queues %s (its placement keeps the data where it is)",
            data_dir / CLUSTER_FILE,
            len(cluster.servers),
            ", ".join(queue.name for queue in cluster.queues),
        )
        _refuse_taken_ports(cluster, "stop what holds them (this cluster's ports are in its cluster file)")
        return cluster
    if not queue_args:
        raise ValueError("give at least one --queue for a new cluster")
    cluster = build_cluster_file(
        queues=[parse_queue_argument(text) for text in queue_args],
        server_count=server_count,
        base_port=base_port,
        metrics_base_port=metrics_base_port,
        lease_duration_ms=lease_duration_ms,
    )
    # Before the cluster file is written: it would keep these ports for every later `up`.
    _refuse_taken_ports(cluster, "stop what holds them, or choose others with --base-port and --metrics-base-port")
    data_dir.mkdir(parents=True, exist_ok=True)
    log.info("wrote %s", write_cluster_file(data_dir, cluster))
    return cluster


def _refuse_taken_ports(cluster: ClusterMap, remedy: str) -> None:
    taken = ports_taken(list(cluster.servers.values()))
    if taken:
        raise ValueError(f"ports in use; {remedy}:\n  " + "\n  ".join(taken))


def _refuse_if_supervised(data_dir: pathlib.Path) -> None:
    """One supervisor per data directory: two would fight over the same leases and ports."""
    record = read_supervisor_record(data_dir)
    if record is None:
        return
    if process_is_alive(record.pid):
        raise click.ClickException(f"a supervisor (pid {record.pid}) already runs the cluster in {data_dir}")
    leftovers = sorted(
        f"{server_id} (pid {entry.pid})"
        for server_id, entry in record.servers.items()
        if entry.pid and is_cluster_server(entry.pid, data_dir=data_dir, server_id=server_id)
    )
    if leftovers:
        # Not stopped for the user: they may be serving someone, and stopping is the user's call.
        raise click.ClickException(
            f"the previous supervisor (pid {record.pid}) died and left servers running: {', '.join(leftovers)}; "
            "stop them, then run `shardq local up` again"
        )
    remove_supervisor_record(data_dir)


def _open_lease_store(data_dir: pathlib.Path) -> tuple[LocalLeaseStore, int]:
    """open_cluster_lease_store, its refusal (an older lease file it cannot read) as a CLI error."""
    try:
        return open_cluster_lease_store(data_dir)
    except ValueError as error:
        raise click.ClickException(f"cannot open the cluster's leases: {error}") from None


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("shard_server.local")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
