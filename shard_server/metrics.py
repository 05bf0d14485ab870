"""Prometheus metrics (DESIGN §8): base units, `_total` counters, queue and shard labels.

Counters are bumped once per committed request, never per message in a loop;
depth gauges are computed from LMDB at scrape time by ShardCollector.

Every sample is a statement about the replica that exports it. In a replicated
cluster only a shard's leader exports its depth and age gauges (followers hold
the same messages: summing by queue would count each once per replica); every
replica exports `shardq_shard_leader` (1 on the leader only) and its epoch.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shard_server.storage.lmdb_store import ShardStats
from shardq.queues import QueueConfig

# No `_created` series: nobody graphs them, and they double the exposition's size.
disable_created_metrics()  # type: ignore[no-untyped-call]
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
COMMITS_AHEAD = Counter(
    "shardq_commits_written_ahead",
    "Of those, the ones answered once their log entry was written ahead, before LMDB's commit "
    "(standalone servers; a receive's batch, answered once its claims are decided, never is).",
    _LABELS,
    registry=REGISTRY,
)
COMMIT_BATCH = Histogram(
    "shardq_commit_batch_requests",
    "Requests folded into one commit (group commit).",
    _LABELS,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
COMMIT_SECONDS = Histogram(
    "shardq_commit_duration_seconds",
    "Write transactions from their start to durable: the batch's LMDB work and its synchronous "
    "writes (the commit-ahead write on a standalone server, else LMDB's commit).",
    _LABELS,
    # A local SSD syncs in tens of microseconds to a millisecond, a network disk in
    # milliseconds; past 100 ms every answer waiting on it is slow.
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "shardq_request_duration_seconds",
    "Server time per RPC (per stream message for streams).",
    ("method",),
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)


REQUESTS = Counter(
    "shardq_requests", "RPCs answered, by method and gRPC status code.", ("method", "code"), registry=REGISTRY
)
STREAM_REQUESTS = Counter(
    "shardq_stream_requests",
    "Requests answered on streams, by stream and the gRPC status code a unary call would have"
    " ended with: SendStream batches, ConsumeStream acknowledgements (AsyncClient sends its"
    " sends and deletes this way).",
    ("method", "code"),
    registry=REGISTRY,
)
OPEN_STREAMS = Gauge(
    "shardq_open_streams",
    "Streaming RPCs open now: consumers, producers, exports, journal reads.",
    ("method",),
    registry=REGISTRY,
)
SENDS_REFUSED = Counter(
    "shardq_messages_refused",
    "Messages a send refused where the shard is, by reason (QUEUE_FULL, NOT_LEADER...).",
    (*_LABELS, "reason"),
    registry=REGISTRY,
)
SENDS_MOVED = Counter(
    "shardq_messages_moved_off_unled_shards",
    "Messages of unkeyed sends stored on another shard than the one chosen, whose leader"
    " this server could not reach (dead, not yet known): by the shard they were moved off.",
    _LABELS,
    registry=REGISTRY,
)
PURGES = Counter("shardq_purges", "Purge requests this server applied.", ("queue",), registry=REGISTRY)
PURGED = Counter("shardq_messages_purged", "Messages removed by purges.", _LABELS, registry=REGISTRY)
BYTES_IN = Counter("shardq_message_bytes_in", "Body bytes of messages stored by send.", _LABELS, registry=REGISTRY)
BYTES_OUT = Counter(
    "shardq_message_bytes_out", "Body bytes of messages handed to receivers.", _LABELS, registry=REGISTRY
)
LEADERSHIP_CHANGES = Counter(
    "shardq_leadership_changes",
    "This server started leading a shard (acquired), stopped because the lease moved on"
    " (lost), or gave it to a follower (handed-off).",
    (*_LABELS, "change"),
    registry=REGISTRY,
)
LEASE_RENEWAL_SECONDS = Histogram(
    "shardq_lease_renewal_duration_seconds",
    "A leader's renewals of its shard leases, from the request to the lease store's answer"
    " (a conflict's reread and retry included), whatever the outcome.",
    # A leader renews every quarter lease and stops serving three quarters past a
    # renewal's request (half a lease of slack): with the operator's 10 s leases a
    # renewal past 5 s lapses, with `shardq local`'s 2 s leases one past 1 s.
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
    registry=REGISTRY,
)
LEASE_LAPSES = Counter(
    "shardq_leader_lease_lapses",
    "Times this leader stopped serving a shard because no renewal of its lease had succeeded"
    " in time (a slow or unreachable lease store, a paused or starved process): requests to"
    " the shard wait or fail over until a renewal succeeds or another replica leads.",
    _LABELS,
    registry=REGISTRY,
)
CLIENT_REVIEWS = Counter(
    "shardq_client_reviews",
    "Questions this server asked the API server about its clients (--client-auth kubernetes):"
    " review is token (TokenReview) or access (SubjectAccessReview); outcome is accepted,"
    " refused, or unanswered (the API server could not say, and the call was refused"
    " UNAVAILABLE). Answers are remembered, so this grows with new clients, not calls.",
    ("review", "outcome"),
    registry=REGISTRY,
)
BUILD = Info("shardq_build", "The shardq and Python versions this server runs.", registry=REGISTRY)


def record_build_info() -> None:
    try:
        version = metadata.version("shardq")
    except metadata.PackageNotFoundError:
        version = "unknown"
    BUILD.info({"version": version, "python": platform.python_version()})


@dataclasses.dataclass(frozen=True, slots=True)
class ShardReport:
    """What one hosted replica says about itself at scrape time."""

    queue: str
    shard: int
    leader: bool
    epoch: int
    commit_index: int
    # Read from LMDB on the leader only (None on followers, or while the shard closes).
    stats: ShardStats | None
    replicas: int
    # Leader of a replicated shard only: replicas in sync (itself included), and
    # how many log entries each follower is behind.
    in_sync_replicas: int | None = None
    follower_lag: dict[str, int] = dataclasses.field(default_factory=dict)


# The queue's configured limits, each a gauge by queue: (metric name, help, value).
def _limits(config: QueueConfig) -> list[tuple[str, str, float]]:
    return [
        ("shardq_queue_max_depth", "The queue's max depth (0: none).", config.max_depth),
        ("shardq_queue_max_message_bytes", "The queue's largest message size.", config.max_message_bytes),
        (
            "shardq_queue_visibility_timeout_seconds",
            "The queue's default visibility timeout.",
            config.visibility_timeout_ms / 1000,
        ),
        ("shardq_queue_retention_seconds", "How long the queue keeps a message.", config.retention_ms / 1000),
        (
            "shardq_queue_max_receives",
            "Receives before a message is dead-lettered (0: never).",
            config.max_receive_count,
        ),
        ("shardq_queue_shards", "Shards the queue has.", config.shards),
    ]


class ShardCollector(Collector):
    """Depth, age, leadership, replication and limits, read from each shard at scrape time."""

    def __init__(
        self,
        shards: Callable[[], Iterable[ShardReport]],
        queues: Callable[[], Iterable[QueueConfig]],
        *,
        now_ms: Callable[[], int],
    ) -> None:
        self._shards = shards
        self._queues = queues
        self._now_ms = now_ms

    def collect(self) -> Iterator[GaugeMetricFamily]:
        def gauge(name: str, documentation: str, labels: tuple[str, ...] = _LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=labels)

        visible = gauge("shardq_messages_visible", "Messages receivable now (the shard's leader only).")
        in_flight = gauge("shardq_messages_in_flight", "Messages claimed (the shard's leader only).")
        delayed = gauge("shardq_messages_delayed", "Messages not visible yet (the shard's leader only).")
        dead = gauge("shardq_messages_dead_letter_pending", "Dead-lettered, not yet handed over (leader only).")
        oldest = gauge(
            "shardq_oldest_message_timestamp_seconds", "Send time of the oldest message (no sample when empty)."
        )
        age = gauge("shardq_oldest_message_age_seconds", "Age of the oldest message; 0 when the shard is empty.")
        epoch = gauge("shardq_shard_epoch", "The fencing epoch this replica knows.")
        leader = gauge("shardq_shard_leader", "1 on the replica that leads (serves) the shard, else 0.")
        index = gauge("shardq_shard_commit_index", "Last committed log index this replica knows.")
        replicas = gauge("shardq_shard_replicas", "Replicas the shard is placed on.")
        isr = gauge("shardq_shard_in_sync_replicas", "Replicas in sync, the leader included (leader only).")
        lag = gauge(
            "shardq_follower_lag_entries",
            "Log entries a follower is behind its leader (leader only).",
            (*_LABELS, "follower"),
        )
        used = gauge("shardq_lmdb_map_used_bytes", "Bytes of LMDB pages in use (leader only).")
        size = gauge("shardq_lmdb_map_size_bytes", "LMDB map size (leader only).")
        now_ms = self._now_ms()
        for report in self._shards():
            labels = [report.queue, str(report.shard)]
            leader.add_metric(labels, 1 if report.leader else 0)
            epoch.add_metric(labels, report.epoch)
            index.add_metric(labels, report.commit_index)
            replicas.add_metric(labels, report.replicas)
            if report.in_sync_replicas is not None:
                isr.add_metric(labels, report.in_sync_replicas)
            for follower, behind in sorted(report.follower_lag.items()):
                lag.add_metric([*labels, follower], behind)
            stats = report.stats
            if stats is None:
                continue
            visible.add_metric(labels, stats.visible)
            in_flight.add_metric(labels, stats.in_flight)
            delayed.add_metric(labels, stats.delayed)
            dead.add_metric(labels, stats.dead_letter_pending)
            if stats.oldest_sent_at_ms:
                oldest.add_metric(labels, stats.oldest_sent_at_ms / 1000)
                age.add_metric(labels, max(now_ms - stats.oldest_sent_at_ms, 0) / 1000)
            else:
                age.add_metric(labels, 0)
            used.add_metric(labels, stats.map_used_bytes)
            size.add_metric(labels, stats.map_size_bytes)
        yield from (
            visible,
            in_flight,
            delayed,
            dead,
            oldest,
            age,
            epoch,
            leader,
            index,
            replicas,
            isr,
            lag,
            used,
            size,
        )
        limit_families: dict[str, GaugeMetricFamily] = {}
        # Which queues are dead-letter queues: an alert on their depth needs to know, and
        # only the source queue's redrive policy says so.
        dead_letter_targets = gauge(
            "shardq_queue_dead_letter_target",
            "1 for each queue whose dead letters go to dead_letter_queue.",
            ("queue", "dead_letter_queue"),
        )
        for config in self._queues():
            for name, documentation, value in _limits(config):
                family = limit_families.get(name)
                if family is None:
                    family = limit_families[name] = gauge(name, documentation, ("queue",))
                family.add_metric([config.name], value)
            if config.dead_letter_queue:
                dead_letter_targets.add_metric([config.name, config.dead_letter_queue], 1)
        yield from limit_families.values()
        yield dead_letter_targets
