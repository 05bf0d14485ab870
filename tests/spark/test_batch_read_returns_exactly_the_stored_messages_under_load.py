"""A batch read of `read=messages` returns exactly what the shards store, while
producers and consumers keep working on the same queue, and the read itself
neither receives nor deletes anything."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from shardq import Client, Message
from tests.support.servers import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

STABLE_MESSAGES = 240
TRAFFIC_SECONDS_MAX = 120.0


class Traffic:
    """A producer of `noise-*` messages and a consumer that deletes only noise.

    The consumer also receives stable messages (it cannot choose) and leaves
    them in flight, so they stay stored: the stable set is known exactly.
    """

    def __init__(self, endpoint: str, queue: str) -> None:
        self.endpoint = endpoint
        self.queue = queue
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.noise_sent: dict[str, bytes] = {}
        self.noise_deleted: set[str] = set()
        self.stable_received: set[str] = set()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._guard(self._produce), name="producer"),
            threading.Thread(target=self._guard(self._consume), name="consumer"),
        ]

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as error:
                self.errors.append(error)
                self.stop.set()

        return run

    def _produce(self) -> None:
        deadline = time.monotonic() + TRAFFIC_SECONDS_MAX
        number = 0
        with Client(self.endpoint) as client:
            while not self.stop.is_set() and time.monotonic() < deadline:
                bodies = [f"noise-{number + i}".encode() for i in range(5)]
                number += len(bodies)
                results = client.send_messages(
                    self.queue, [Message(body=body, attributes={"kind": "noise"}) for body in bodies]
                )
                with self.lock:
                    for result, body in zip(results, bodies, strict=True):
                        assert result.ok, result
                        self.noise_sent[result.message_id] = body

    def _consume(self) -> None:
        deadline = time.monotonic() + TRAFFIC_SECONDS_MAX
        with Client(self.endpoint) as client:
            while not self.stop.is_set() and time.monotonic() < deadline:
                received = client.receive_messages(
                    self.queue, max_messages=10, visibility_timeout_ms=600_000, wait_time_ms=100
                )
                noise = [m for m in received if m.attributes.get("kind") == "noise"]
                with self.lock:
                    self.stable_received.update(m.message_id for m in received if m.attributes.get("kind") == "stable")
                if noise:
                    results = client.delete_messages(self.queue, [m.receipt for m in noise])
                    with self.lock:
                        self.noise_deleted.update(m.message_id for m, r in zip(noise, results, strict=True) if r.ok)

    def progress(self) -> tuple[int, int]:
        with self.lock:
            return len(self.noise_sent), len(self.noise_deleted)

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def wait_for_progress(traffic: Traffic, *, sent: int, deleted: int) -> None:
    def reached() -> bool:
        if traffic.errors:
            raise traffic.errors[0]
        now_sent, now_deleted = traffic.progress()
        return now_sent >= sent and now_deleted >= deleted

    wait_for(reached, timeout=30.0, what=f"{sent} sent and {deleted} deleted by the traffic")


@pytest.fixture
def endpoint(start_server) -> str:
    return start_server(["orders:shards=4,visibility=10m"])


def send_stable_messages(endpoint: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    stable: dict[str, tuple[bytes, dict[str, str]]] = {}
    with Client(endpoint) as client:
        for first in range(0, STABLE_MESSAGES, 8):
            messages = [
                Message(body=f"stable-{i}".encode(), attributes={"kind": "stable", "i": str(i)})
                for i in range(first, first + 8)
            ]
            for message, result in zip(messages, client.send_messages("orders", messages), strict=True):
                assert result.ok, result
                stable[result.message_id] = (message.body, message.attributes)
    return stable


def test_snapshot_during_traffic_holds_every_stable_message_and_only_sent_ones(endpoint: str, read_queue) -> None:
    stable = send_stable_messages(endpoint)
    frame = read_queue(endpoint, "orders", "messages", includeBody="true")

    with Traffic(endpoint, "orders") as traffic:
        wait_for_progress(traffic, sent=50, deleted=20)
        before = traffic.progress()
        during = frame.collect()
        after = traffic.progress()
    assert not traffic.errors, traffic.errors
    # The read really overlapped with sends and deletes.
    assert after[0] > before[0], (before, after)
    assert after[1] > before[1], (before, after)

    ids = [row["message_id"] for row in during]
    assert len(ids) == len(set(ids)), "a message appeared twice in one snapshot"
    stable_rows = {row["message_id"]: row for row in during if row["attributes"].get("kind") == "stable"}
    assert set(stable_rows) == set(stable)
    for message_id, (body, attributes) in stable.items():
        row = stable_rows[message_id]
        assert (bytes(row["body"]), row["attributes"], row["size"]) == (body, attributes, len(body))
        assert row["state"] in ("VISIBLE", "IN_FLIGHT")
        assert row["queue"] == "orders"
    noise_rows = {row["message_id"]: bytes(row["body"]) for row in during if row["attributes"].get("kind") == "noise"}
    assert len(noise_rows) + len(stable_rows) == len(during)
    # Every noise row is a message a producer sent, with its body.
    assert noise_rows.items() <= traffic.noise_sent.items()
    assert {row["shard"] for row in during} == {0, 1, 2, 3}


def test_quiet_snapshot_equals_sent_minus_deleted_and_reading_changes_nothing(endpoint: str, read_queue) -> None:
    stable = send_stable_messages(endpoint)
    with Traffic(endpoint, "orders") as traffic:
        wait_for_progress(traffic, sent=100, deleted=40)
    assert not traffic.errors, traffic.errors

    frame = read_queue(endpoint, "orders", "messages", includeBody="true")
    expected = {message_id: body for message_id, (body, _) in stable.items()}
    expected.update({mid: body for mid, body in traffic.noise_sent.items() if mid not in traffic.noise_deleted})
    first = {row["message_id"]: bytes(row["body"]) for row in frame.collect()}
    assert first == expected

    # Reading twice returns the same: the export neither claims nor deletes.
    rows = frame.collect()
    assert {row["message_id"]: bytes(row["body"]) for row in rows} == expected
    with Client(endpoint) as client:
        attributes = client.attributes("orders")
    assert attributes.visible + attributes.in_flight == len(expected)
    assert attributes.in_flight == len(traffic.stable_received)
    received_counts = {row["message_id"]: row["receive_count"] for row in rows}
    assert all(received_counts[mid] == 1 for mid in traffic.stable_received)
    assert all(received_counts[mid] == 0 for mid in expected if mid not in traffic.stable_received)


def test_bodies_stay_on_the_server_unless_asked_for(endpoint: str, read_queue) -> None:
    send_stable_messages(endpoint)
    rows = read_queue(endpoint, "orders", "messages").select("body", "size").collect()
    assert len(rows) == STABLE_MESSAGES
    assert all(row["body"] is None and row["size"] > 0 for row in rows)
