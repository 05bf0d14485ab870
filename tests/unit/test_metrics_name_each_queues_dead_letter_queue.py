"""/metrics says which queues are dead-letter queues (`shardq_queue_dead_letter_target`):
the chart's dead-letter alert and dashboard find them by it, not by a naming convention."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shard_server.metrics import ShardCollector
from shardq.queues import QueueConfig


def scrape(*queues: QueueConfig) -> list[tuple[str, dict[str, str], float]]:
    registry = CollectorRegistry()
    registry.register(ShardCollector(list, lambda: list(queues), now_ms=lambda: 0))
    text = generate_latest(registry).decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_each_queue_with_a_redrive_policy_names_its_dead_letter_queue() -> None:
    found = scrape(
        QueueConfig("orders", dead_letter_queue="orders-dlq", max_receive_count=5),
        QueueConfig("payments", dead_letter_queue="orders-dlq", max_receive_count=2),
        QueueConfig("orders-dlq"),
    )
    targets = sorted(
        (labels["queue"], labels["dead_letter_queue"], value)
        for name, labels, value in found
        if name == "shardq_queue_dead_letter_target"
    )
    # The dead-letter queue itself, with no redrive policy of its own, names none.
    assert targets == [("orders", "orders-dlq", 1.0), ("payments", "orders-dlq", 1.0)]


def test_no_queue_with_a_redrive_policy_means_no_sample() -> None:
    found = scrape(QueueConfig("plain"))
    assert [sample for sample in found if sample[0] == "shardq_queue_dead_letter_target"] == []
    # The queue's other limits are still there.
    assert ("shardq_queue_shards", {"queue": "plain"}, 1.0) in found
