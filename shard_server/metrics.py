"""Prometheus metrics (DESIGN §8): base units, `_total` counters, queue and shard labels.

Counters are bumped once per committed request, never per message in a loop;
depth gauges are computed from LMDB at scrape time by ShardCollector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shard_server.storage.lmdb_store import ShardStats

REGISTRY = CollectorRegistry(auto_describe=True)
_LABELS = ("queue", "shard")

SENT = Counter("shardq_messages_sent", "Messages stored by send.", _LABELS, registry=REGISTRY)
DUPLICATES = Counter(
    "shardq_send_duplicates", "Sends answered from the dedup window; nothing stored.", _LABELS, registry=REGISTRY
)
RECEIVED = Counter("shardq_messages_received", "Messages handed to receivers.", _LABELS, registry=REGISTRY)
REDELIVERED = Counter(
    "shardq_messages_redelivered", "Receives of a message that had been received before.", _LABELS, registry=REGISTRY
)
DELETED = Counter("shardq_messages_deleted", "Messages deleted with a valid receipt.", _LABELS, registry=REGISTRY)
RELEASED = Counter("shardq_messages_released", "Messages released (nack) with backoff.", _LABELS, registry=REGISTRY)
DEAD_LETTERED = Counter(
    "shardq_messages_dead_lettered",
    "Messages moved toward the dead-letter queue.",
    (*_LABELS, "reason"),
    registry=REGISTRY,
)
EXPIRED = Counter("shardq_messages_expired", "Messages removed by retention.", _LABELS, registry=REGISTRY)
REJECTED_RECEIPTS = Counter(
    "shardq_receipts_rejected", "Receipts refused, by reason.", (*_LABELS, "reason"), registry=REGISTRY
)
COMMITS = Counter("shardq_commits", "Write transactions committed (one fsync each).", _LABELS, registry=REGISTRY)
COMMIT_BATCH = Histogram(
    "shardq_commit_batch_requests",
    "Requests folded into one commit (group commit).",
    _LABELS,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "shardq_request_duration_seconds",
    "Server time per RPC (per stream message for streams).",
    ("method",),
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)


class ShardCollector(Collector):
    """Depth, age, epoch and map usage read from each shard at scrape time."""

    def __init__(self, shards: Callable[[], Iterable[tuple[str, int, Callable[[], ShardStats]]]]) -> None:
        self._shards = shards

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "visible": GaugeMetricFamily("shardq_messages_visible", "Messages receivable now.", labels=_LABELS),
            "in_flight": GaugeMetricFamily("shardq_messages_in_flight", "Messages claimed.", labels=_LABELS),
            "delayed": GaugeMetricFamily("shardq_messages_delayed", "Messages not visible yet.", labels=_LABELS),
            "dead": GaugeMetricFamily(
                "shardq_messages_dead_letter_pending", "Dead-lettered, not yet handed over.", labels=_LABELS
            ),
            "oldest": GaugeMetricFamily(
                "shardq_oldest_message_timestamp_seconds", "Send time of the oldest message (0: empty).", labels=_LABELS
            ),
            "epoch": GaugeMetricFamily("shardq_shard_epoch", "The shard's fencing epoch.", labels=_LABELS),
            "leader": GaugeMetricFamily("shardq_shard_leader", "1 where this server leads the shard.", labels=_LABELS),
            "index": GaugeMetricFamily("shardq_shard_commit_index", "Last committed log index.", labels=_LABELS),
            "used": GaugeMetricFamily("shardq_lmdb_map_used_bytes", "Bytes of LMDB pages in use.", labels=_LABELS),
            "size": GaugeMetricFamily("shardq_lmdb_map_size_bytes", "LMDB map size.", labels=_LABELS),
        }
        for queue, shard, read_stats in self._shards():
            stats = read_stats()
            labels = [queue, str(shard)]
            families["visible"].add_metric(labels, stats.visible)
            families["in_flight"].add_metric(labels, stats.in_flight)
            families["delayed"].add_metric(labels, stats.delayed)
            families["dead"].add_metric(labels, stats.dead_letter_pending)
            families["oldest"].add_metric(labels, stats.oldest_sent_at_ms / 1000)
            families["epoch"].add_metric(labels, stats.epoch)
            families["leader"].add_metric(labels, 1)
            families["index"].add_metric(labels, stats.last_index)
            families["used"].add_metric(labels, stats.map_used_bytes)
            families["size"].add_metric(labels, stats.map_size_bytes)
        yield from families.values()
