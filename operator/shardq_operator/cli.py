"""`shardq operator`: run the operator (contributed to the shardq CLI)."""

from __future__ import annotations

import logging
import os
import pathlib

import click


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
def operator_command(
    namespaces: tuple[str, ...],
    kubeconfig: pathlib.Path | None,
    standalone: bool,
    metrics_port: int,
    metrics_host: str,
) -> None:
    """Reconcile ShardqCluster and Queue resources into shard servers, and fail shards over."""
    # Imported here: the CLI starts fast, and only this command needs kopf.
    import kopf

    from shardq.coordination.kubernetes_leases import connect
    from shardq_operator import handlers, metrics
    from shardq_operator.kube import Kube
    from shardq_operator.reconciling import Reconciler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kopf's own login reads it
    handlers.use(Reconciler(Kube(connect(kubeconfig=kubeconfig))))
    if metrics_port:
        try:
            metrics.serve_metrics(metrics_host, metrics_port)
        except OSError as error:
            raise click.ClickException(
                f"cannot serve metrics on {metrics_host}:{metrics_port}: {error.strerror}"
            ) from None
    kopf.run(standalone=standalone, namespaces=list(namespaces), clusterwide=not namespaces)
