"""Dead-lettering and redrive when the queue and its dead-letter queue are led by different
servers, and the caller talks to yet another: the mover hands dead letters to the DLQ's
leader, and a redrive through any server moves every message, wherever its shard is led,
to the queue named or (no destination) back to the queue it came from, which the DLQ's
leader elsewhere tells in the message's attributes.
(Before, redrive counted only the DLQ shards led by the server it was called on, and
through any other server it moved nothing: "moved 0", found on the real node.)"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from shardq import Client
from shardq.coordination.cluster_map import QueueEntry
from tests.support.clusters import Cluster, running, send_once_led
from tests.support.servers import drain, wait_for

# orders on s1 and s2 (s1 leads); orders-dlq on s2 and s3 (s2 leads): s1 holds no DLQ copy,
# s3 holds only a follower's.
ORDERS = [["s1", "s2"]]
DLQ = "orders-dlq"
DLQ_PLACEMENT = [["s2", "s3"]]


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    yield from running(
        Cluster(
            tmp_path / "cluster",
            placement=ORDERS,
            spec={"dead_letter_queue": DLQ, "max_receive_count": 1},
            more_queues=[(QueueEntry(DLQ, {"shards": 1, "replicas": 2}), DLQ_PLACEMENT)],
        )
    )


def visible(client: Client, queue: str) -> int:
    return client.attributes(queue).visible


@pytest.mark.timeout(120)
@pytest.mark.parametrize("redrive_through", ["s1", "s3"])
@pytest.mark.parametrize("destination", ["orders", ""], ids=["named", "back-where-it-came-from"])
def test_a_poison_message_reaches_the_dlq_and_redrives_through_any_server(
    cluster: Cluster, redrive_through: str, destination: str
) -> None:
    with Client(cluster.endpoint("s1"), route_directly=False) as client:
        sent = send_once_led(client, b"poison")
        (received,) = client.receive_messages("orders", max_messages=1, visibility_timeout_ms=200, wait_time_ms=5_000)
        assert received.message_id == sent.message_id
        # The next eligible delivery dead-letters it: s1 leads orders, s2 leads the DLQ.
        wait_for(
            lambda: (
                client.receive_messages("orders", max_messages=1, wait_time_ms=500) == [] and visible(client, DLQ) == 1
            ),
            timeout=30,
            what="the poison message in the DLQ led by another server",
        )
    with Client(cluster.endpoint(redrive_through), route_directly=False) as client:
        progress = list(client.redrive(source=DLQ, destination=destination))
        assert progress[-1].done
        assert (progress[-1].moved, progress[-1].kept) == (1, 0), progress
        assert visible(client, DLQ) == 0
        (back,) = drain(client, "orders")
        assert back.body == b"poison"
