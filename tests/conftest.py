"""Fixtures for integration tests: a real shard server subprocess per test."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from shardq import Client
from tests.support.clusters import Cluster, KubernetesLeases, running
from tests.support.ports import free_port
from tests.support.servers import DEFAULT_QUEUES, ServerFactory, ServerProcess


@pytest.fixture
def server_factory(tmp_path: pathlib.Path) -> Iterator[ServerFactory]:
    """Start servers with custom queues: `server_factory("q:max_depth=10")`."""
    started: list[ServerProcess] = []

    def make(*queues: str) -> ServerProcess:
        name = f"server{len(started)}"
        server = ServerProcess(
            data_dir=tmp_path / name / "data",
            queues=queues or DEFAULT_QUEUES,
            port=free_port(),
            metrics_port=free_port(),
            log_path=tmp_path / name / "server.log",
        )
        server.log_path.parent.mkdir(parents=True, exist_ok=True)
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.cleanup()


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    """A server hosting `orders` (4 shards, DLQ orders-dlq after 2 receives), `orders-dlq`, `fifo`."""
    return server_factory()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint) as client:
        yield client


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """Three replicated servers (s1..s3) over a local lease store, stopped after the test."""
    yield from running(Cluster(tmp_path))


@pytest.fixture
def kubernetes_cluster(tmp_path: pathlib.Path, kubeconfig: pathlib.Path, namespace: str) -> Iterator[Cluster]:
    """The same three servers, holding their shard leases as Lease objects on the real
    control plane (`--lease-store kubernetes`, read through a watch)."""
    yield from running(Cluster(tmp_path, kubernetes=KubernetesLeases(kubeconfig, namespace)))
