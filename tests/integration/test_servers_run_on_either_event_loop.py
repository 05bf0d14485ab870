"""The server runs on uvloop by default and on asyncio's own loop when asked, and keeps
every acknowledged send across a SIGKILL on both; the blocking client's loop follows
SHARDQ_EVENT_LOOP; a loop that cannot be had is refused with a message naming it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from shardq import Client, Message
from tests.support.ports import free_port
from tests.support.servers import ServerProcess, drain

QUEUE = "loops"
MESSAGES = 120


@pytest.mark.parametrize(("option", "expected"), [((), "uvloop"), (("--event-loop", "asyncio"), "asyncio")])
def test_acknowledged_sends_survive_sigkill_on_each_loop(
    tmp_path: pathlib.Path, option: tuple[str, ...], expected: str
) -> None:
    server = ServerProcess.in_directory(tmp_path, [f"{QUEUE}:shards=2"], *option)
    server.start()
    try:
        assert f"event loop {expected}" in server.log()
        with Client(server.endpoint) as client:
            acknowledged = set()
            for number in range(MESSAGES):
                # One call in flight at a time, as a web handler sends: the path uvloop shortens.
                body = b"m%d" % number
                assert client.send_messages(QUEUE, [Message(body)])[0].ok
                acknowledged.add(body)
        server.kill()
        server.start()
        with Client(server.endpoint) as client:
            received = {message.body for message in drain(client, QUEUE)}
        assert received == acknowledged
    finally:
        server.cleanup()


def test_the_blocking_client_runs_on_the_loop_the_environment_names() -> None:
    code = (
        "import asyncio; from shardq import Client\n"
        "client = Client('127.0.0.1:1')\n"
        "async def kind(): return type(asyncio.get_running_loop()).__module__\n"
        "print(client._run(kind())); client.close()\n"
    )

    def loop_module(choice: str | None) -> subprocess.CompletedProcess[str]:
        environment = {key: value for key, value in os.environ.items() if key != "SHARDQ_EVENT_LOOP"}
        if choice is not None:
            environment["SHARDQ_EVENT_LOOP"] = choice
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment, check=False
        )

    assert loop_module(None).stdout.strip().startswith("uvloop")
    assert loop_module("asyncio").stdout.strip().startswith("asyncio")
    refused = loop_module("trio")
    assert refused.returncode != 0
    assert "unknown event loop 'trio'" in refused.stderr


def test_a_server_asked_for_a_missing_uvloop_says_so(tmp_path: pathlib.Path) -> None:
    # uvloop made unimportable, as on a machine without its wheel.
    code = "import sys; sys.modules['uvloop'] = None; from shardq.cli import main; main()"
    args = ["serve", "--data-dir", str(tmp_path / "data"), "--queue", QUEUE, "--port", str(free_port())]
    refused = subprocess.run(
        [sys.executable, "-c", code, *args, "--event-loop", "uvloop"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1
    assert "event loop 'uvloop' asked for but uvloop is not installed" in refused.stderr
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())
