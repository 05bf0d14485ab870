"""Binary encodings of records, delivery states and log entries (struct, no pickle).

Layouts are versioned by the log entry's leading byte; decoding a layout we do
not know fails loudly rather than guessing.
"""

from __future__ import annotations

import struct

from shard_server.domain.events import (
    ChangeKind,
    DedupPruned,
    DeliveryChanged,
    Event,
    LogEntry,
    Purged,
    RemovalKind,
    Removed,
    Sent,
)
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord
from shardq.queues import MAX_PRIORITY_LANES

_RECORD_HEAD = struct.Struct(">QqHHHHI")  # seq, sent_at, len group, dedup, source, n attrs, body len
_ATTRIBUTE_HEAD = struct.Struct(">HI")
_DELIVERY = struct.Struct(">BIqqqqQQ")
_ENTRY_HEAD = struct.Struct(">BQQqI")  # layout version, epoch, index, at_ms, event count
_EVENT_LENGTH = struct.Struct(">I")
_SENT_HEAD = struct.Struct(">BQqI")  # tag, seq, dedup expiry, record length
_CHANGED_HEAD = struct.Struct(">BBQH")  # tag, kind, seq, reason length
_REMOVED = struct.Struct(">BBQq")
_PURGED = struct.Struct(">BQQ")
_PRUNED = struct.Struct(">Bq")

ENTRY_LAYOUT = 1
TAG_SENT = 1
TAG_CHANGED = 2
TAG_REMOVED = 3
TAG_PURGED = 4
TAG_PRUNED = 5


class CorruptEntry(ValueError):
    pass


# DeliveryState by its stored number.
_STATES = tuple(sorted(DeliveryState, key=int))
assert [int(state) for state in _STATES] == list(range(len(_STATES)))
# A delivery's state byte holds its state in the low four bits and its priority lane in
# the high four: a message of lane 0 (every message of a queue without lanes, and every
# one stored before lanes existed) is encoded as it always was.
_STATE_BITS = 0x0F
_PRIORITY_SHIFT = 4
assert len(_STATES) <= _STATE_BITS + 1


def encode_record(record: MessageRecord) -> bytes:
    if not (record.attributes or record.group_id or record.dedup_id or record.source_queue):
        # The common message: one header and the body (hot path).
        return _RECORD_HEAD.pack(record.seq, record.sent_at_ms, 0, 0, 0, 0, len(record.body)) + record.body
    group = record.group_id.encode()
    dedup = record.dedup_id.encode()
    source = record.source_queue.encode()
    parts = [
        _RECORD_HEAD.pack(
            record.seq,
            record.sent_at_ms,
            len(group),
            len(dedup),
            len(source),
            len(record.attributes),
            len(record.body),
        ),
        group,
        dedup,
        source,
    ]
    for key, value in record.attributes.items():
        key_bytes, value_bytes = key.encode(), value.encode()
        parts.append(_ATTRIBUTE_HEAD.pack(len(key_bytes), len(value_bytes)))
        parts.append(key_bytes)
        parts.append(value_bytes)
    parts.append(record.body)
    return b"".join(parts)


def decode_record(data: bytes | memoryview) -> MessageRecord:
    raw = data if isinstance(data, bytes) else bytes(data)
    seq, sent_at, group_len, dedup_len, source_len, attribute_count, body_len = _RECORD_HEAD.unpack_from(raw)
    position = _RECORD_HEAD.size
    if not (group_len or dedup_len or source_len or attribute_count):
        body = raw[position:]  # the common message: nothing but the body (hot path)
        if len(body) != body_len:
            raise CorruptEntry(f"record {seq}: body length {len(body)}, header says {body_len}")
        return MessageRecord(seq, sent_at, body, {}, "", "", "")
    group = raw[position : position + group_len].decode()
    position += group_len
    dedup = raw[position : position + dedup_len].decode()
    position += dedup_len
    source = raw[position : position + source_len].decode()
    position += source_len
    attributes: dict[str, str] = {}
    for _ in range(attribute_count):
        key_len, value_len = _ATTRIBUTE_HEAD.unpack_from(raw, position)
        position += _ATTRIBUTE_HEAD.size
        key = raw[position : position + key_len].decode()
        position += key_len
        attributes[key] = raw[position : position + value_len].decode()
        position += value_len
    body = raw[position : position + body_len]
    if len(body) != body_len:
        raise CorruptEntry(f"record {seq}: body truncated")
    return MessageRecord(seq, sent_at, body, attributes, group, dedup, source)


def encode_delivery(delivery: Delivery) -> bytes:
    fixed = _DELIVERY.pack(
        delivery.state | delivery.priority << _PRIORITY_SHIFT,
        delivery.receive_count,
        delivery.sent_at_ms,
        delivery.visible_at_ms,
        delivery.first_received_at_ms,
        delivery.last_received_at_ms,
        delivery.claim_epoch,
        delivery.claim_token,
    )
    # The last release reason, when there is one, follows the fixed part (a delivery
    # is always the last part of what holds it, so its length is the remainder).
    return fixed + delivery.last_error.encode() if delivery.last_error else fixed


def decode_delivery(seq: int, data: bytes | memoryview) -> Delivery:
    state_byte, count, sent_at, visible_at, first, last, epoch, token = _DELIVERY.unpack_from(data)
    state = state_byte & _STATE_BITS
    try:
        known = _STATES[state]  # a tuple lookup: DeliveryState(state) costs 5x more
    except IndexError:
        raise CorruptEntry(f"message {seq}: unknown delivery state {state}") from None
    priority = state_byte >> _PRIORITY_SHIFT
    if priority >= MAX_PRIORITY_LANES:
        raise CorruptEntry(f"message {seq}: priority {priority} is above every queue's lanes")
    last_error = bytes(data[_DELIVERY.size :]).decode() if len(data) > _DELIVERY.size else ""
    return Delivery(
        seq, known, sent_at, visible_at, count, first, last, epoch, token, last_error, state_byte >> _PRIORITY_SHIFT
    )


def encode_sent(event: Sent, record: bytes, delivery: bytes) -> bytes:
    """A Sent event around its already-encoded record and delivery (stores reuse the bytes)."""
    return b"".join(
        (_SENT_HEAD.pack(TAG_SENT, event.record.seq, event.dedup_expires_at_ms, len(record)), record, delivery)
    )


def encode_delivery_changed(event: DeliveryChanged, delivery: bytes) -> bytes:
    """A DeliveryChanged event around its already-encoded delivery (stores reuse the bytes)."""
    if not event.reason:  # a claim's (hot path)
        return _CHANGED_HEAD.pack(TAG_CHANGED, event.kind, event.delivery.seq, 0) + delivery
    reason = event.reason.encode()
    return b"".join((_CHANGED_HEAD.pack(TAG_CHANGED, event.kind, event.delivery.seq, len(reason)), reason, delivery))


def encode_event(event: Event) -> bytes:
    if isinstance(event, Sent):
        return encode_sent(event, encode_record(event.record), encode_delivery(event.delivery))
    if isinstance(event, DeliveryChanged):
        return encode_delivery_changed(event, encode_delivery(event.delivery))
    if isinstance(event, Removed):
        return _REMOVED.pack(TAG_REMOVED, event.kind, event.seq, event.sent_at_ms)
    if isinstance(event, Purged):
        return _PURGED.pack(TAG_PURGED, event.up_to_seq, event.count)
    if isinstance(event, DedupPruned):
        return _PRUNED.pack(TAG_PRUNED, event.up_to_ms)
    raise TypeError(f"unknown event {event!r}")  # pragma: no cover


def decode_event(data: bytes) -> Event:
    tag = data[0]
    if tag == TAG_SENT:
        _, seq, expires, record_len = _SENT_HEAD.unpack_from(data)
        start = _SENT_HEAD.size
        record = decode_record(data[start : start + record_len])
        return Sent(record, decode_delivery(seq, data[start + record_len :]), expires)
    if tag == TAG_CHANGED:
        _, kind, seq, reason_len = _CHANGED_HEAD.unpack_from(data)
        start = _CHANGED_HEAD.size
        reason = data[start : start + reason_len].decode()
        return DeliveryChanged(ChangeKind(kind), decode_delivery(seq, data[start + reason_len :]), reason)
    if tag == TAG_REMOVED:
        _, kind, seq, sent_at = _REMOVED.unpack(data)
        return Removed(RemovalKind(kind), seq, sent_at)
    if tag == TAG_PURGED:
        _, up_to, count = _PURGED.unpack(data)
        return Purged(up_to, count)
    if tag == TAG_PRUNED:
        _, up_to_ms = _PRUNED.unpack(data)
        return DedupPruned(up_to_ms)
    raise CorruptEntry(f"unknown event tag {tag}")


def encode_entry(*, epoch: int, index: int, at_ms: int, encoded_events: list[bytes]) -> bytes:
    parts = [_ENTRY_HEAD.pack(ENTRY_LAYOUT, epoch, index, at_ms, len(encoded_events))]
    for encoded in encoded_events:
        parts.append(_EVENT_LENGTH.pack(len(encoded)))
        parts.append(encoded)
    return b"".join(parts)


def decode_entry_head(data: bytes | memoryview) -> tuple[int, int, int, int]:
    """(epoch, index, at_ms, event count) without decoding the events."""
    layout, epoch, index, at_ms, count = _ENTRY_HEAD.unpack_from(data)
    if layout != ENTRY_LAYOUT:
        raise CorruptEntry(f"log entry layout {layout} is not supported")
    return epoch, index, at_ms, count


def decode_entry(data: bytes | memoryview) -> LogEntry:
    raw = bytes(data)
    epoch, index, at_ms, count = decode_entry_head(raw)
    position = _ENTRY_HEAD.size
    events: list[Event] = []
    for _ in range(count):
        (length,) = _EVENT_LENGTH.unpack_from(raw, position)
        position += _EVENT_LENGTH.size
        events.append(decode_event(raw[position : position + length]))
        position += length
    return LogEntry(epoch, index, at_ms, tuple(events))
