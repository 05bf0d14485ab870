"""`shardq serve`: contributed to the shardq CLI through the `shardq.cli` entry point."""

from __future__ import annotations

import asyncio
import pathlib

import click
import yaml

from shard_server.logs import configure_logging
from shard_server.server import ServerSettings, serve
from shardq.queues import QueueConfig, parse_queue_option, queue_config_from_spec


def load_queue_file(path: pathlib.Path) -> list[QueueConfig]:
    """queues.yaml: `queues: {name: {spec as in a Queue resource}}` or a list of {name, ...}."""
    data = yaml.safe_load(path.read_text()) or {}
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


@click.command("serve")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False, path_type=pathlib.Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7600, show_default=True, type=int)
@click.option("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
@click.option("--queue", "queue_specs", multiple=True, help="name[:shards=4,fifo=true,visibility=30s,...]")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=pathlib.Path))
@click.option("--map-size", default="64GiB", show_default=True, help="LMDB map size per shard")
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True)
def serve_command(
    data_dir: pathlib.Path,
    host: str,
    port: int,
    metrics_port: int | None,
    queue_specs: tuple[str, ...],
    config_file: pathlib.Path | None,
    map_size: str,
    log_format: str,
) -> None:
    """Run a shard server hosting the given queues."""
    try:
        configs = [parse_queue_option(spec) for spec in queue_specs]
        if config_file is not None:
            configs += load_queue_file(config_file)
        size = _parse_size(map_size)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    if not configs:
        raise click.UsageError("give at least one --queue or a --config file")
    configure_logging(json_lines=log_format == "json")
    settings = ServerSettings(
        data_dir=data_dir, queues=configs, host=host, port=port, metrics_port=metrics_port, map_size=size
    )
    try:
        asyncio.run(serve(settings))
    except ValueError as error:
        raise click.ClickException(str(error)) from None


def _parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered.removesuffix(suffix)) * factor)
    return int(lowered)
