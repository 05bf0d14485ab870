"""run_consumer's second SIGINT (or SIGTERM): the first starts nothing new and waits for
the handlers running; the second waits for none, gives their messages back at once with
the prefetched ones, and the process ends, a handler stuck in its thread included.
Before, a second Ctrl-C did nothing, and a stuck handler could only be ended with
SIGKILL, its messages hidden until their visibility timeout. A real server, and the
consumer in a real process sent real signals, blocking and async."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from shardq import Client, Message
from tests.support.consumer_scripts import ASYNC_CONSUMER, BLOCKING_CONSUMER
from tests.support.servers import ServerProcess, wait_for

QUEUE = "orders-dlq"
MESSAGES = 5
WORKERS = 2
# Handlers that never finish on their own: a thread's in `time.sleep`, a coroutine's in
# `asyncio.sleep`.
CONSUMERS = {"blocking": BLOCKING_CONSUMER, "async": ASYNC_CONSUMER}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(CONSUMERS))
def test_a_second_signal_stops_without_waiting_and_gives_every_message_back(
    kind: str, server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    bodies = [b"m%d" % n for n in range(MESSAGES)]
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(body) for body in bodies])
    started_log = tmp_path / "started.txt"
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMERS[kind], server.endpoint, str(started_log), QUEUE, str(WORKERS), "3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: started_log.exists() and len(started_log.read_text().split()) == WORKERS,
            timeout=30,
            what="both handlers to start",
        )
        os.kill(consumer.pid, signal.SIGINT)
        time.sleep(1.5)
        assert consumer.poll() is None, "the first signal waits for the running handlers"
        os.kill(consumer.pid, signal.SIGINT)
        out, err = consumer.communicate(timeout=30)  # TimeoutExpired: the second signal did nothing
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 0, err
    assert out.strip() == f"handled 0, cut off {WORKERS}"
    assert "signal again to stop without waiting" in err
    with Client(server.endpoint) as client:
        # Every message is visible again at once (the consumer claimed them for 120 s).
        deadline = time.monotonic() + 5
        back: list[bytes] = []
        while len(back) < MESSAGES and time.monotonic() < deadline:
            back += [m.body for m in client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)]
    assert sorted(back) == bodies
