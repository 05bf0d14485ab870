"""`shardq operator`: run the operator (contributed to the shardq CLI)."""

from __future__ import annotations

import logging
import os
import pathlib
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from shardq.serving_certificates import ServingCertificate

SERVICE_ACCOUNT_NAMESPACE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
METRICS_CERT_FLAG = "--metrics-tls-cert-file"


def _pod_namespace() -> str:
    if not SERVICE_ACCOUNT_NAMESPACE.exists():
        raise click.UsageError("--leader-lease-namespace (or --namespace) is needed outside a pod")
    return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()


@click.command("operator")
@click.option("--namespace", "namespaces", multiple=True, help="serve this namespace (repeatable); default: all")
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="the API server to use (default: the pod's service account)",
)
@click.option("--standalone/--peering", default=True, show_default=True, help="run without kopf peering objects")
@click.option(
    "--metrics-port", type=int, default=9700, show_default=True, help="serve Prometheus /metrics here (0: off)"
)
@click.option("--metrics-host", default="0.0.0.0", show_default=True)
@click.option(
    METRICS_CERT_FLAG,
    "metrics_tls_cert_file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="serve /metrics over HTTPS with this certificate (a PEM chain), read again when it changes",
)
@click.option(
    "--metrics-tls-key-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="the private key of --metrics-tls-cert-file",
)
@click.option(
    "--leader-lease-namespace",
    default=None,
    help="where the replicas' leader Lease lives (default: the first --namespace, or the pod's namespace)",
)
@click.option("--leader-lease-duration", default="5s", show_default=True, help="how long a silent leader keeps acting")
@click.option(
    "--identity", default=None, help="this replica's name in the leader Lease (default: pod name, or host-pid)"
)
@click.option(
    "--peer-key-file",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    default=None,
    help="the key every cluster's peer secret is derived from (at least 32 printable characters; the chart "
    "makes one); without it clusters run without a peer secret, and their servers take any caller for a peer",
)
def operator_command(
    namespaces: tuple[str, ...],
    kubeconfig: pathlib.Path | None,
    standalone: bool,
    metrics_port: int,
    metrics_host: str,
    metrics_tls_cert_file: pathlib.Path | None,
    metrics_tls_key_file: pathlib.Path | None,
    leader_lease_namespace: str | None,
    leader_lease_duration: str,
    identity: str | None,
    peer_key_file: pathlib.Path | None,
) -> None:
    """Reconcile ShardqCluster and Queue resources into shard servers, and fail shards over."""
    # Imported here: the CLI starts fast, and only this command needs kopf.
    import kopf

    from shardq.coordination.kubernetes_leases import connect
    from shardq_operator import handlers, metrics
    from shardq_operator.kube import Kube
    from shardq_operator.reconciling import Reconciler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").addFilter(handlers.StandbyIsNotAnError())
    logging.getLogger("kopf.objects").addFilter(handlers.RoutineTicksAreQuiet())
    if kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kopf's own login reads it
    from shardq.coordination.kubernetes_leases import KubernetesLeaseStore
    from shardq.coordination.peer_credentials import NO_PEER_SECRET, read_peer_secret
    from shardq.durations import parse_duration_ms
    from shardq_operator.leadership import OperatorLeadership, default_identity

    metrics_certificate = _metrics_certificate(metrics_tls_cert_file, metrics_tls_key_file) if metrics_port else None
    try:
        peer_key = NO_PEER_SECRET if peer_key_file is None else read_peer_secret(peer_key_file)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--peer-key-file") from None
    if peer_key.secret is None:
        logging.getLogger(__name__).warning(
            "no --peer-key-file: clusters run without a peer secret, and their servers take any caller for a peer"
        )
    lease_namespace = leader_lease_namespace or (namespaces[0] if namespaces else _pod_namespace())
    try:
        duration_ms = parse_duration_ms(leader_lease_duration)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--leader-lease-duration") from None
    try:
        api = connect(kubeconfig=kubeconfig)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    leadership = OperatorLeadership(
        KubernetesLeaseStore(api, namespace=lease_namespace, watch=False),
        identity=identity or default_identity(),
        duration_ms=duration_ms,
    )
    # kopf reads --namespace values as patterns; only plain names need no namespace listing.
    named = bool(namespaces) and not any(set(n) & set("*?!,") for n in namespaces)
    handlers.use(Reconciler(Kube(api), peer_key=peer_key), leadership, named_namespaces=named)
    leadership.keep_renewing()
    if metrics_port:
        try:
            metrics.serve_metrics(metrics_host, metrics_port, metrics_certificate)
        except OSError as error:
            raise click.ClickException(
                f"cannot serve metrics on {metrics_host}:{metrics_port}: {error.strerror}"
            ) from None
    kopf.run(standalone=standalone, namespaces=list(namespaces), clusterwide=not namespaces)


def _metrics_certificate(cert: pathlib.Path | None, key: pathlib.Path | None) -> ServingCertificate | None:
    """The pair the metrics port serves HTTPS with, loaded (and its expiry logged) now; a
    pair given half, or that does not load, stops the operator with one line naming it."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise click.UsageError(f"{METRICS_CERT_FLAG} and --metrics-tls-key-file go together")
    from shardq.errors import InvalidArgument
    from shardq.serving_certificates import ServingCertificate

    try:
        return ServingCertificate(cert, key, option=METRICS_CERT_FLAG)
    except InvalidArgument as error:
        raise click.ClickException(error.message) from None
