"""Request validation: every bound checked, every error naming its field.

Runs before anything is stored, so a bad request changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shard_server.domain.messages import NewMessage
from shardq.durations import format_duration_ms
from shardq.errors import InvalidArgument
from shardq.queues import (
    MAX_ATTRIBUTE_KEY_CHARS,
    MAX_ATTRIBUTES,
    MAX_ATTRIBUTES_BYTES,
    MAX_BATCH_BYTES,
    MAX_ID_CHARS,
    MAX_RECEIVE_BATCH,
    MAX_RECEIVE_SHARES,
    MAX_SEND_BATCH,
    MAX_WAIT_MS,
    QueueConfig,
)


def _id_problem(name: str, value: str) -> tuple[str, str] | None:
    if len(value) > MAX_ID_CHARS:
        return name, f"at most {MAX_ID_CHARS} characters, got {len(value)}"
    if value and not value.isprintable():
        return name, "must be printable characters"
    return None


def _message_problem(
    config: QueueConfig,
    body: bytes,
    attributes: Mapping[str, str],
    group_id: str,
    dedup_id: str,
    delay: int,
    priority: int,
    *,
    reserved_allowed: bool = False,
) -> tuple[str, str] | None:
    """(field suffix, what is wrong) for the first problem, or None."""
    attribute_bytes = 0
    if attributes:  # most messages have none: skip the per-key work (hot path)
        if len(attributes) > MAX_ATTRIBUTES:
            return "attributes", f"at most {MAX_ATTRIBUTES} attributes, got {len(attributes)}"
        for key, value in attributes.items():
            if not key or len(key) > MAX_ATTRIBUTE_KEY_CHARS:
                return "attributes", f"keys must be 1..{MAX_ATTRIBUTE_KEY_CHARS} characters"
            if key.startswith(RESERVED_ATTRIBUTE_PREFIX) and not reserved_allowed:
                return "attributes", f"keys starting with {RESERVED_ATTRIBUTE_PREFIX!r} are reserved for shardq"
            attribute_bytes += len(key.encode()) + len(value.encode())
        if attribute_bytes > MAX_ATTRIBUTES_BYTES:
            return "attributes", f"at most {MAX_ATTRIBUTES_BYTES} bytes in all"
    size = len(body) + attribute_bytes
    if size > config.max_message_bytes:
        return "body", f"message is {size} bytes with attributes; the queue allows {config.max_message_bytes}"
    if group_id or dedup_id:
        problem = _id_problem("group_id", group_id) or _id_problem("dedup_id", dedup_id)
        if problem is not None:
            return problem
    if config.fifo and not group_id:
        return "group_id", "required on a FIFO queue"
    if not 0 <= delay <= config.retention_ms:
        return "delay_ms", f"must be 0s..{_shown(config.retention_ms)} (the retention period), got {_shown(delay)}"
    if priority and priority >= config.priority_lanes:
        lanes = config.priority_lanes
        if lanes == 1:
            return "priority", f"queue {config.name!r} has no priority lanes (priorityLanes 1): give 0, got {priority}"
        return "priority", f"must be 0..{lanes - 1} (queue {config.name!r} has {lanes} priority lanes), got {priority}"
    return None


def validate_message(
    config: QueueConfig,
    *,
    index: int,
    body: bytes,
    attributes: Mapping[str, str],
    group_id: str,
    dedup_id: str,
    delay_ms: int | None,
    priority: int = 0,
    reserved_allowed: bool = False,
) -> NewMessage:
    """Check one message of a send batch; `index` names it in the error.

    `reserved_allowed`: a batch forwarded by another server may carry reserved attributes
    (a dead letter it moves to a DLQ led here); that server refused them from its clients."""
    delay = config.delivery_delay_ms if delay_ms is None else delay_ms
    problem = _message_problem(
        config, body, attributes, group_id, dedup_id, delay, priority, reserved_allowed=reserved_allowed
    )
    if problem is not None:
        raise InvalidArgument(f"messages[{index}].{problem[0]}", problem[1])
    return NewMessage(body, dict(attributes) if attributes else {}, group_id, dedup_id, delay, "", priority)


def validate_batch_size(field: str, count: int, limit: int) -> None:
    if not 1 <= count <= limit:
        raise InvalidArgument(field, f"must hold 1..{limit} entries, got {count}")


def validate_send_batch(count: int, total_bytes: int) -> None:
    validate_batch_size("messages", count, MAX_SEND_BATCH)
    if total_bytes > MAX_BATCH_BYTES:
        raise InvalidArgument("messages", f"batch is {total_bytes} bytes; at most {MAX_BATCH_BYTES}")


MAX_RELEASE_REASON_CHARS = 1024
# Attribute keys the server sets on moved copies (dead letters); senders may not.
RESERVED_ATTRIBUTE_PREFIX = "shardq."


def validate_release_reason(field: str, reason: str) -> None:
    if len(reason) > MAX_RELEASE_REASON_CHARS:
        raise InvalidArgument(field, f"at most {MAX_RELEASE_REASON_CHARS} characters, got {len(reason)}")


def _shown(ms: int) -> str:
    """A duration as people write it (4d, 90s, 250ms); negative ones as given."""
    return format_duration_ms(ms) if ms >= 0 else f"{ms}ms"


def resolve_visibility_timeout(config: QueueConfig, field: str, value: int | None) -> int:
    timeout = config.visibility_timeout_ms if value is None else value
    if not 0 <= timeout <= config.retention_ms:
        raise InvalidArgument(
            field, f"must be 0s..{_shown(config.retention_ms)} (the retention period), got {_shown(timeout)}"
        )
    return timeout


def validate_receive(config: QueueConfig, *, max_messages: int, visibility_timeout_ms: int | None, wait_ms: int) -> int:
    """Check a receive request; returns the visibility timeout to use."""
    if not 1 <= max_messages <= MAX_RECEIVE_BATCH:
        raise InvalidArgument("max_messages", f"must be 1..{MAX_RECEIVE_BATCH}, got {max_messages}")
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise InvalidArgument("wait_time_ms", f"must be 0s..{_shown(MAX_WAIT_MS)}, got {_shown(wait_ms)}")
    return resolve_visibility_timeout(config, "visibility_timeout_ms", visibility_timeout_ms)


def validate_shares(shares: Sequence[int], *, max_messages: int, wait_ms: int, peek: bool) -> None:
    """Check a shared short poll: one max_messages per receiver, nothing else that
    would apply to all of them at once."""
    if not 1 <= len(shares) <= MAX_RECEIVE_SHARES:
        raise InvalidArgument("shares", f"at most {MAX_RECEIVE_SHARES} receivers share a request, got {len(shares)}")
    if max_messages:
        raise InvalidArgument("max_messages", "must be 0 with shares: each share is one receiver's max_messages")
    if wait_ms:
        raise InvalidArgument("wait_time_ms", "must be 0 with shares: a shared receive is a short poll")
    if peek:
        raise InvalidArgument("peek", "cannot be used with shares")
    for position, wanted in enumerate(shares):
        if not 1 <= wanted <= MAX_RECEIVE_BATCH:
            raise InvalidArgument(f"shares[{position}]", f"must be 1..{MAX_RECEIVE_BATCH}, got {wanted}")


def validate_receipts(field: str, receipts: Sequence[str]) -> None:
    validate_batch_size(field, len(receipts), MAX_RECEIVE_BATCH)
