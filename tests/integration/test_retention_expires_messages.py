"""Invariant 7: retention removes old messages and counts them on /metrics."""

from __future__ import annotations

import urllib.request

from shardq import Client, Message
from tests.support.servers import ServerFactory, ServerProcess, stored_count, wait_for

QUEUE = "short"


def expired_total(server: ServerProcess, queue: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("shardq_messages_expired_total{") and f'queue="{queue}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_messages_older_than_retention_expire_and_are_counted(server_factory: ServerFactory) -> None:
    server = server_factory(f"{QUEUE}:retention=2s,shards=2,visibility=1s,dedup_window=1s,nack_backoff_max=1s", "keep")
    assert expired_total(server, QUEUE) == 0
    with Client(server.endpoint) as client:
        for i in range(3):  # one call each: spread over both shards
            client.send_messages(QUEUE, [Message(b"old %d" % i), Message(b"older %d" % i)])
        client.send_messages("keep", [Message(b"kept")])
        assert stored_count(client, QUEUE) == 6
        wait_for(lambda: stored_count(client, QUEUE) == 0, timeout=15, interval=0.2, what="messages to expire")
        wait_for(lambda: expired_total(server, QUEUE) >= 6, timeout=5, what="the expired counter")
        assert expired_total(server, QUEUE) == 6
        assert client.receive_messages(QUEUE, max_messages=10) == []
        assert stored_count(client, "keep") == 1
        assert expired_total(server, "keep") == 0
