"""What a client does on its callers' behalf ends with them, and is not repeated for each:

- a blocking `Client` call interrupted by Ctrl-C stops: an abandoned long poll, left
  running on the client's loop thread, claimed the next message for nobody;
- a burst of first calls to a queue asks its shard map once: each asked, and thousands
  of DescribeQueue calls at a client's start crowded out the calls themselves.

A real server; Ctrl-C is a real SIGINT to a real client process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from shardq import AsyncClient, Client, Message
from tests.integration.scraping import scraped_total
from tests.support.servers import ServerProcess

INTERRUPTED_RECEIVER = textwrap.dedent(
    """
    import sys, time
    from shardq import Client
    with Client(sys.argv[1]) as client:
        print("polling", flush=True)
        try:
            client.receive_messages("orders", max_messages=1, wait_time_ms=15_000, visibility_timeout_ms=60_000)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        # The process lives on, as an application that caught Ctrl-C does.
        sys.stdin.readline()
    """
)


def test_a_long_poll_interrupted_by_ctrl_c_claims_nothing_afterwards(server: ServerProcess, client: Client) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_RECEIVER, server.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as receiver:
        try:
            assert receiver.stdout is not None
            assert receiver.stdin is not None
            assert receiver.stdout.readline().strip() == "polling"
            time.sleep(1)  # its long poll waits on the server (an abandoned one went on either way)
            receiver.send_signal(signal.SIGINT)
            assert receiver.stdout.readline().strip() == "interrupted"
            client.send("orders", b"after ctrl-c")
            got = client.receive_messages("orders", max_messages=1, wait_time_ms=5_000)
            assert [m.body for m in got] == [b"after ctrl-c"], "the interrupted long poll claimed the message"
            receiver.stdin.write("\n")
            receiver.stdin.flush()
            assert receiver.wait(timeout=15) == 0
        finally:
            if receiver.poll() is None:
                receiver.kill()


def test_a_burst_of_first_calls_asks_for_the_shard_map_once(server: ServerProcess) -> None:
    def describes() -> float:
        return scraped_total(server.metrics_url, "shardq_requests_total", method="QueueService/DescribeQueue")

    before = describes()

    async def burst() -> None:
        async with AsyncClient(server.endpoint) as fresh:
            await asyncio.gather(*(fresh.send_messages("orders", [Message(b"%d" % n)]) for n in range(200)))

    asyncio.run(burst())
    assert describes() - before == 1


def test_a_closed_client_says_so(server: ServerProcess) -> None:
    """A call on a closed blocking Client raised "Event loop is closed" with a warning that
    a coroutine was never awaited; it says what is wrong now, and warns of nothing."""
    client = Client(server.endpoint)
    client.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="this Client is closed"):
            client.send("orders", b"too late")
