"""`shardq serve` runs gRPC with socket I/O on the completion-queue thread (one thread
hand-off fewer per message each way than gRPC's EventEngine default; see
shardq/grpc_io.py and bench/LATENCY.md), says so when it starts, and keeps
gRPC's default when the user set GRPC_EXPERIMENTS, even to nothing. Either way it
serves: a send and a receive round trip."""

from __future__ import annotations

import pathlib

import pytest

from shardq import Client, Message
from tests.support.servers import ServerProcess, drain


@pytest.mark.parametrize(
    ("environment", "said"),
    [
        (None, "socket I/O on the completion-queue thread"),
        ("", "gRPC's default I/O (EventEngine threads)"),
    ],
)
def test_the_server_names_its_grpc_io_and_serves_with_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, environment: str | None, said: str
) -> None:
    if environment is None:
        monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    else:
        monkeypatch.setenv("GRPC_EXPERIMENTS", environment)
    server = ServerProcess.in_directory(tmp_path, ["orders:shards=2"])
    server.start()
    try:
        (line,) = [line for line in server.log().splitlines() if "serving orders on" in line]
        assert line.endswith(said), line
        with Client(server.endpoint) as client:
            assert all(result.ok for result in client.send_messages("orders", [Message(b"a"), Message(b"b")]))
            assert sorted(message.body for message in drain(client, "orders")) == [b"a", b"b"]
    finally:
        server.cleanup()
