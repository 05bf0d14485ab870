"""run_consumer on SIGTERM: starts nothing new, finishes what runs, and gives back
every message it had prefetched at once (not at their visibility timeout)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from shardq import Client, Message
from tests.support.consumer_scripts import ASYNC_CONSUMER
from tests.support.servers import ServerProcess, wait_for

QUEUE = "orders-dlq"
MESSAGES = 12


def test_sigterm_starts_nothing_new_and_gives_back_prefetched_messages(
    server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"m%d" % n) for n in range(MESSAGES)])
    started_log = tmp_path / "started.txt"
    consumer = subprocess.Popen(
        [sys.executable, "-c", ASYNC_CONSUMER, server.endpoint, str(started_log), QUEUE, "3", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: started_log.exists() and len(started_log.read_text().split()) >= 3,
            timeout=30,
            what="three handlers to start",
        )
        os.kill(consumer.pid, signal.SIGTERM)
        out, err = consumer.communicate(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 0, err
    started = started_log.read_text().split()
    assert len(started) == 3, f"handlers started after SIGTERM: {started}"
    assert out.strip() == "handled 3, cut off 0"
    with Client(server.endpoint) as client:
        # Everything not handled is visible right away (the consumer claimed them for 120 s).
        deadline = time.monotonic() + 5
        back: list[bytes] = []
        while len(back) < MESSAGES - 3 and time.monotonic() < deadline:
            back += [m.body for m in client.receive_messages(QUEUE, max_messages=10, visibility_timeout_ms=60_000)]
        assert sorted(back) == sorted(
            b"m%d" % n for n in range(MESSAGES) if b"m%d" % n not in {s.encode() for s in started}
        )
