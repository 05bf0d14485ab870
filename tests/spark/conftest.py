"""Fixtures for the Spark tests: one local SparkSession per test session, and
real shard servers (`python -m shardq serve`) on 127.0.0.1 per test."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.servers import ServerFactory, wait_for

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_READY_SECONDS = 30.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: runs a local Spark session against real shard servers")


# Set for the whole test session once Spark starts: Spark's Python workers are separate
# processes that unpickle our data source by module name, so they need the repository
# on their path even when shardq is not installed.
_ENVIRONMENT = pytest.MonkeyPatch()
_started: list[SparkSession] = []


def _start_spark() -> SparkSession:
    from pyspark.sql import SparkSession

    import shardq.spark

    _ENVIRONMENT.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    session = (
        # local[2,2]: two cores, and a failed task is attempted once more, as on a
        # cluster; plain local[2] never retries, and the retried-write test needs a retry.
        SparkSession.builder.master("local[2,2]")
        .appName("shardq-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    shardq.spark.register(session)
    _started.append(session)
    return session


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start Spark before the first test when any collected test needs it. Starting it
    forks this process to launch the JVM, and gRPC does not support a fork while its
    threads are busy ("Other threads are currently calling into gRPC, skipping fork()
    handlers"): in one CI run, with earlier tests' gRPC threads still live, the JVM
    launch died there and every Spark test errored with JAVA_GATEWAY_EXITED. Before the
    first test, this process has no gRPC threads."""
    if any("spark" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_spark()


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = _started[0] if _started else _start_spark()
    yield session
    session.stop()
    _ENVIRONMENT.undo()


def wait_until_serving(endpoint: str) -> None:
    """The standard gRPC health check answers SERVING (polled, with a deadline)."""

    def serving() -> bool:
        with grpc.insecure_channel(endpoint) as channel, contextlib.suppress(grpc.RpcError):
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return answer.status == health_pb2.HealthCheckResponse.SERVING
        return False

    wait_for(serving, timeout=SERVER_READY_SECONDS, what=f"health SERVING at {endpoint}")


ServerStarter = Callable[[Sequence[str]], str]
FrameReader = Callable[..., "DataFrame"]


@pytest.fixture
def start_server(server_factory: ServerFactory) -> ServerStarter:
    """`start_server(["orders:shards=4", ...])` starts a real shard server on 127.0.0.1
    (the integration tests' harness: own port and data dir, SIGTERM by PID at the
    end) and returns its endpoint once it reports SERVING."""

    def start(queue_specs: Sequence[str]) -> str:
        server = server_factory(*queue_specs)
        wait_until_serving(server.endpoint)
        return server.endpoint

    return start


@pytest.fixture
def read_queue(spark: SparkSession) -> FrameReader:
    """`read_queue(endpoint, queue, read="journal", **options)`: a shardq DataFrame."""

    def read(endpoint: str, queue: str, read: str = "messages", **options: str) -> DataFrame:
        reader = spark.read.format("shardq").option("endpoint", endpoint).option("queue", queue).option("read", read)
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load()

    return read
