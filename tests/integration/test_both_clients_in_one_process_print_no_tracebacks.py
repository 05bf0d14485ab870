"""AsyncClients under `asyncio.run`, then a blocking Client, in one process: a script's
ordinary sequence. Once one of them had waited for a server that refused it, grpc.aio's
process-wide poller woke the ended run's closed loop, and stderr filled with "Event loop
is closed" tracebacks although every call worked."""

from __future__ import annotations

import subprocess
import sys

from tests.support.ports import free_port
from tests.support.servers import ServerProcess

SCRIPT = """
import asyncio, sys
from shardq import AsyncClient, Client, Message

endpoint, nobody = sys.argv[1], sys.argv[2]

async def first() -> None:
    async with AsyncClient(endpoint) as client:
        await asyncio.gather(*(client.send("orders", b"async %d" % n) for n in range(20)))
    try:
        async with AsyncClient(nobody) as client:  # waits out its grace for a restart
            await client.send_messages("orders", [Message(b"refused")])
    except Exception as error:
        print(type(error).__name__)

asyncio.run(first())
with Client(endpoint) as client:
    for n in range(20):
        client.send_messages("orders", [Message(b"blocking %d" % n)])
    print(client.attributes("orders").visible)
"""


def test_an_async_client_then_a_blocking_one_work_and_print_nothing_on_stderr(server: ServerProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.endpoint, f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Unavailable", "40"]
    assert done.stderr == ""
