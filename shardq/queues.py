"""Queue settings: one typed record, its limits, and parsing from a Queue spec.

The same parser reads `shardq serve --queue` specs, queues.yaml files and (later)
the operator's Queue custom resources, so a setting means one thing everywhere.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from shardq.durations import MAX_DURATION_MS, parse_duration_ms, shown_briefly
from shardq.errors import InvalidArgument, QueueNotFound
from shardq.sizes import KIB, MAX_SIZE_BYTES, MIB, NotASize, parse_size

DAY_MS = 86_400_000

# Hard ceilings: what a queue may be configured to, not the defaults.
MAX_SHARDS = 1024
MAX_REPLICAS = 7
MAX_MESSAGE_BYTES_CEILING = 16 * MIB
MAX_RETENTION_MS = 366 * DAY_MS
MAX_RECEIVE_BATCH = 1000
# Receivers one shared short poll may carry (shardq.receive_shares): each share may
# claim 1/n of what one receive may, so more would starve each other when messages are large.
MAX_RECEIVE_SHARES = 16
MAX_SEND_BATCH = 1000
MAX_BATCH_BYTES = 48 * MIB
MAX_ATTRIBUTES = 64
MAX_ATTRIBUTE_KEY_CHARS = 256
MAX_ATTRIBUTES_BYTES = 256 * KIB
MAX_ID_CHARS = 128  # group ids and dedup ids
# Priorities 0..9, as RabbitMQ advises for its priority queues (each lane is an index a
# receive may look through; a delivery keeps its priority in four bits of its state byte).
MAX_PRIORITY_LANES = 10
MAX_WAIT_MS = 15 * 60_000
QUEUE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueConfig:
    name: str
    shards: int = 1
    replicas: int = 1
    fifo: bool = False
    visibility_timeout_ms: int = 30_000
    retention_ms: int = 4 * DAY_MS
    max_message_bytes: int = 1 * MIB
    delivery_delay_ms: int = 0
    dedup_window_ms: int = 5 * 60_000
    # A message sent without a dedup id gets one from its body (shardq.routing.content_dedup_id),
    # as SQS's ContentBasedDeduplication: a repeat of a send needs no id of its own.
    content_based_dedup: bool = False
    dead_letter_queue: str = ""
    max_receive_count: int = 0  # 0: never dead-letter
    max_depth: int = 0  # 0: unbounded
    nack_backoff_base_ms: int = 1_000
    nack_backoff_max_ms: int = 5 * 60_000
    journal_retention_ms: int = DAY_MS
    # 1: every message has priority 0. More: a message chooses 0..priority_lanes - 1, and a
    # shard delivers its eligible messages highest lane first.
    priority_lanes: int = 1
    # How long a receive that gives no wait of its own long-polls (SQS's
    # ReceiveMessageWaitTimeSeconds): 0, at once.
    receive_wait_ms: int = 0

    def __post_init__(self) -> None:
        validate_queue_config(self)


def check_queue_name(name: str) -> None:
    """Raise InvalidArgument unless `name` could be a queue's name; never echoes more than a little of it."""
    if not name:
        raise InvalidArgument("queue", "a queue name is required")
    if not QUEUE_NAME.fullmatch(name):
        raise InvalidArgument(
            "queue", f"{shown_briefly(name)} is not a queue name: a DNS label (a-z, 0-9, '-', at most 63)"
        )


# What a queue name can start with: QUEUE_NAME without its last character's rule.
QUEUE_NAME_PREFIX = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def check_queue_prefix(prefix: str) -> None:
    """Raise InvalidArgument unless `prefix` is empty or could start a queue name: a
    prefix no name can have (capitals, an underscore) is a mistake, not an empty list."""
    if prefix and not QUEUE_NAME_PREFIX.fullmatch(prefix):
        raise InvalidArgument(
            "prefix",
            f"no queue name starts with {shown_briefly(prefix)}: names are a DNS label (a-z, 0-9, '-' but not"
            " first, at most 63)",
        )


def queues_listed(
    dead_letter_targets: Mapping[str, str], *, prefix: str = "", dead_letter_queue: str = ""
) -> list[str]:
    """The names ListQueues answers, sorted: of the queues in `dead_letter_targets` (each
    name's dead-letter queue, "" for none), those starting with `prefix` and, given a
    `dead_letter_queue`, sending their dead letters there. Raises InvalidArgument for a
    prefix or a dead-letter queue that cannot be a name, QueueNotFound for one that is not."""
    check_queue_prefix(prefix)
    if dead_letter_queue:
        try:
            check_queue_name(dead_letter_queue)
        except InvalidArgument as error:
            raise InvalidArgument("dead_letter_queue", error.message.removeprefix("queue: ")) from None
        if dead_letter_queue not in dead_letter_targets:
            raise QueueNotFound(dead_letter_queue)
    return sorted(
        name
        for name, target in dead_letter_targets.items()
        if name.startswith(prefix) and (not dead_letter_queue or target == dead_letter_queue)
    )


def validate_queue_config(config: QueueConfig) -> None:
    """Raise ValueError naming the first setting that is out of range."""
    checks: list[tuple[bool, str]] = [
        (bool(QUEUE_NAME.fullmatch(config.name)), "name must be a DNS label (a-z, 0-9, '-', at most 63)"),
        (1 <= config.shards <= MAX_SHARDS, f"shards must be 1..{MAX_SHARDS}"),
        (1 <= config.replicas <= MAX_REPLICAS, f"replicas must be 1..{MAX_REPLICAS}"),
        (1_000 <= config.retention_ms <= MAX_RETENTION_MS, "retention must be 1s..366d"),
        (0 <= config.visibility_timeout_ms <= config.retention_ms, "visibility timeout must be 0..retention"),
        (0 <= config.delivery_delay_ms <= config.retention_ms, "delivery delay must be 0..retention"),
        (0 <= config.dedup_window_ms <= config.retention_ms, "dedup window must be 0..retention"),
        (
            config.dedup_window_ms > 0 or not config.content_based_dedup,
            "contentBasedDedup needs a dedup window (a dedupWindow of 0 remembers nothing to compare with)",
        ),
        (1 <= config.max_message_bytes <= MAX_MESSAGE_BYTES_CEILING, "max message size must be 1B..16MiB"),
        (config.max_receive_count >= 0, "max receive count must be >= 0"),
        (config.max_depth >= 0, "max depth must be >= 0"),
        (0 < config.nack_backoff_base_ms <= config.nack_backoff_max_ms, "nack backoff must be 0 < base <= max"),
        (0 <= config.journal_retention_ms <= MAX_RETENTION_MS, "journal retention must be 0..366d"),
        (1 <= config.priority_lanes <= MAX_PRIORITY_LANES, f"priority lanes must be 1..{MAX_PRIORITY_LANES}"),
        (0 <= config.receive_wait_ms <= MAX_WAIT_MS, "receive wait must be 0..15m (a long poll's limit)"),
        (
            config.priority_lanes == 1 or not config.fifo,
            "a FIFO queue has no priority lanes: it delivers each group in send order",
        ),
        (config.dead_letter_queue != config.name, "a queue cannot be its own dead-letter queue"),
        (
            bool(config.dead_letter_queue) == (config.max_receive_count > 0),
            "dead_letter_queue and max_receive_count go together "
            "(to remove a redrive policy, set deadLetterQueue= and maxReceiveCount=0)",
        ),
    ]
    for ok, problem in checks:
        if not ok:
            raise ValueError(f"queue {config.name!r}: {problem}")


# Spec keys as written in a Queue resource (camelCase) or on the command line
# (snake_case), mapped to the field and how to read the value.
_DURATION_FIELDS = {
    "visibility": "visibility_timeout_ms",
    "visibilitytimeout": "visibility_timeout_ms",
    "retention": "retention_ms",
    "deliverydelay": "delivery_delay_ms",
    "delay": "delivery_delay_ms",
    "dedupwindow": "dedup_window_ms",
    "nackbackoffbase": "nack_backoff_base_ms",
    "nackbackoffmax": "nack_backoff_max_ms",
    "journalretention": "journal_retention_ms",
    "receivewait": "receive_wait_ms",
    # SQS's attribute (in seconds, as a bare number here is).
    "receivemessagewaittimeseconds": "receive_wait_ms",
}
_INT_FIELDS = {
    "shards": "shards",
    "replicas": "replicas",
    "maxmessagebytes": "max_message_bytes",
    "maxmessagesize": "max_message_bytes",
    "maxreceivecount": "max_receive_count",
    "maxdepth": "max_depth",
    "prioritylanes": "priority_lanes",
}
_BOOL_FIELDS = {
    "fifo": "fifo",
    "contentbaseddedup": "content_based_dedup",
    # SQS's attribute name, so a queue described as in SQS is read as meant.
    "contentbaseddeduplication": "content_based_dedup",
}
# What a queue's settings are called, for error messages and docs.
SETTING_NAMES = (
    "shards",
    "replicas",
    "fifo",
    "visibilityTimeout",
    "retention",
    "deliveryDelay",
    "dedupWindow",
    "contentBasedDedup",
    "maxMessageBytes",
    "maxReceiveCount",
    "deadLetterQueue",
    "redrivePolicy",
    "maxDepth",
    "nackBackoffBase",
    "nackBackoffMax",
    "journalRetention",
    "priorityLanes",
    "receiveWait",
)


def _normalise_key(key: str) -> str:
    return key.replace("_", "").replace("-", "").lower()


def _parse_int(key: str, value: Any) -> int:
    """A whole number, maybe with a size unit (maxMessageBytes=64KiB, and so maxDepth=1k)."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        number = parse_size(str(value))
    except NotASize:
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    except ValueError:
        raise ValueError(f"{key}: expected a number up to {MAX_SIZE_BYTES}, got {shown_briefly(str(value))}") from None
    # "1.5k" is 1536, as exact as "1536"; "1.3k" would be 1331.2, and rounding it would
    # quietly set something other than what was written.
    whole = int(number)
    if whole != number:
        raise ValueError(
            f"{key}: expected a whole number, got {shown_briefly(str(value))} (between {whole} and {whole + 1})"
        )
    return whole


def _parse_duration(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        # Bare numbers are seconds, as in SQS (YAML's .inf and .nan among them).
        if not 0 <= value * 1000 <= MAX_DURATION_MS:  # NaN fails every comparison
            raise ValueError(f"{key}: {value!r} is not a duration of 0 to {MAX_DURATION_MS} ms")
        return round(value * 1000)
    try:
        return parse_duration_ms(str(value))
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"{key}: expected true or false, got {value!r}")


class _Fields(dict[str, Any]):
    """A QueueConfig's fields as spec keys set them, refusing a second key for one field:
    `visibility=10s` beside `visibilityTimeout=20s` once kept whichever came last."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[str, str] = {}

    def set(self, field: str, key: str, value: Any) -> None:
        earlier = self._keys.get(field)
        if earlier is not None:
            # Sorted: a spec from a protobuf map (CreateQueue's settings) has no order.
            first, second = sorted((earlier, key))
            raise ValueError(f"{first} and {second} set the same setting: give one of them")
        self._keys[field] = key
        self[field] = value


def queue_config_from_spec(name: str, spec: Mapping[str, Any]) -> QueueConfig:
    """Build a QueueConfig from a Queue spec mapping; unknown keys, and two keys for one
    setting, are errors."""
    fields = _Fields()
    for key, value in spec.items():
        normal = _normalise_key(key)
        if normal in _DURATION_FIELDS:
            fields.set(_DURATION_FIELDS[normal], key, _parse_duration(key, value))
        elif normal in _INT_FIELDS:
            fields.set(_INT_FIELDS[normal], key, _parse_int(key, value))
        elif normal in _BOOL_FIELDS:
            fields.set(_BOOL_FIELDS[normal], key, _parse_bool(key, value))
        elif normal in ("deadletterqueue", "dlq"):
            fields.set("dead_letter_queue", key, str(value))
        elif normal == "redrivepolicy":
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}: expected a mapping with deadLetterQueue and maxReceiveCount")
            for sub_key, sub_value in value.items():
                sub = _normalise_key(sub_key)
                if sub == "deadletterqueue":
                    fields.set("dead_letter_queue", f"{key}.{sub_key}", str(sub_value))
                elif sub == "maxreceivecount":
                    fields.set("max_receive_count", f"{key}.{sub_key}", _parse_int(sub_key, sub_value))
                else:
                    raise ValueError(f"{key}.{sub_key}: unknown setting; valid: deadLetterQueue, maxReceiveCount")
        elif normal == "name":
            if str(value) != name:
                raise ValueError(f"name: {value!r} does not match {name!r}")
        else:
            raise ValueError(
                f"{key}: unknown queue setting; valid (camelCase or snake_case): {', '.join(SETTING_NAMES)}"
            )
    return QueueConfig(name=name, **fields)


def _fields_set_by(key: str) -> set[str]:
    normal = _normalise_key(key)
    if normal in _DURATION_FIELDS:
        return {_DURATION_FIELDS[normal]}
    if normal in _INT_FIELDS:
        return {_INT_FIELDS[normal]}
    if normal in _BOOL_FIELDS:
        return {_BOOL_FIELDS[normal]}
    if normal in ("deadletterqueue", "dlq"):
        return {"dead_letter_queue"}
    if normal == "redrivepolicy":
        return {"dead_letter_queue", "max_receive_count"}
    return {normal}  # name, or unknown (refused when parsed)


def merged_spec(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`current` with `changes` applied, each change replacing the current key that sets
    the same setting however either is spelled (`visibility` replaces `visibilityTimeout`:
    kept side by side, they are two keys for one setting, which a spec refuses)."""
    changed = {field for key in changes for field in _fields_set_by(key)}
    kept: dict[str, Any] = {}
    for key, value in current.items():
        if not _fields_set_by(key) & changed:
            kept[key] = value
        elif _normalise_key(key) == "redrivepolicy" and isinstance(value, Mapping):
            # A change to one half of the policy keeps the other half.
            for sub_key, sub_value in value.items():
                if not _fields_set_by(sub_key) & changed:
                    kept[sub_key] = sub_value
    return {**kept, **changes}


def parse_queue_option(text: str) -> QueueConfig:
    """Parse `name[:key=value,key=value...]` as given to `shardq serve --queue`."""
    name, _, rest = text.partition(":")
    spec: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--queue {text!r}: {item!r} is not key=value")
        if key.strip() in spec:
            raise ValueError(f"--queue {text!r}: {key.strip()} is given twice")
        spec[key.strip()] = value.strip()
    return queue_config_from_spec(name.strip(), spec)
