"""Exported protobuf batches to Arrow RecordBatches of the documented schemas.

Column-at-a-time: one comprehension per column over the batch, timestamps
converted in numpy, so the per-message Python work is one attribute read per
column. Proto3 has no nulls: 0 timestamps and empty strings become nulls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from shardq.api.v1 import export_pb2
from shardq.spark.schemas import journal_arrow_schema, messages_arrow_schema

_TIMESTAMP = pa.timestamp("us", tz="UTC")

_EVENT_TYPE_PREFIX = "JOURNAL_EVENT_TYPE_"
EVENT_TYPE_NAMES: dict[int, str] = {
    number: name.removeprefix(_EVENT_TYPE_PREFIX) for name, number in export_pb2.JournalEventType.items()
}
_STATE_PREFIX = "MESSAGE_STATE_"
MESSAGE_STATE_NAMES: dict[int, str] = {
    number: name.removeprefix(_STATE_PREFIX) for name, number in export_pb2.MessageState.items()
}
_PURGED = export_pb2.JOURNAL_EVENT_TYPE_PURGED
# Event types whose `size` / `receive_count` the server fills; elsewhere the
# proto3 default 0 means "not carried" and becomes null.
_CARRIES_SIZE = frozenset({export_pb2.JOURNAL_EVENT_TYPE_SENT})
_CARRIES_RECEIVE_COUNT = frozenset(
    {
        export_pb2.JOURNAL_EVENT_TYPE_SENT,
        export_pb2.JOURNAL_EVENT_TYPE_RECEIVED,
        export_pb2.JOURNAL_EVENT_TYPE_VISIBILITY_CHANGED,
        export_pb2.JOURNAL_EVENT_TYPE_RELEASED,
        export_pb2.JOURNAL_EVENT_TYPE_DEAD_LETTERED,
    }
)


def _timestamps_from_ms(values_ms: Sequence[int]) -> pa.Array:
    millis = np.asarray(values_ms, dtype=np.int64)
    return pa.array(millis * 1000, type=_TIMESTAMP, mask=millis == 0)


def journal_batch_from_proto(queue: str, events: Sequence[export_pb2.JournalEvent]) -> pa.RecordBatch:
    columns = [
        pa.array([queue] * len(events), type=pa.string()),
        pa.array([event.shard for event in events], type=pa.int32()),
        pa.array([event.log_index for event in events], type=pa.int64()),
        pa.array([event.epoch for event in events], type=pa.int64()),
        _timestamps_from_ms([event.at_ms for event in events]),
        pa.array([EVENT_TYPE_NAMES.get(event.type, "UNSPECIFIED") for event in events], type=pa.string()),
        # PURGED is about many messages at once: it has no message fields.
        pa.array([e.seq if e.type != _PURGED else None for e in events], type=pa.int64()),
        pa.array([event.message_id or None for event in events], type=pa.string()),
        _timestamps_from_ms([event.sent_at_ms for event in events]),
        pa.array([e.size if e.type in _CARRIES_SIZE else None for e in events], type=pa.int32()),
        pa.array([e.receive_count if e.type in _CARRIES_RECEIVE_COUNT else None for e in events], type=pa.int32()),
        _timestamps_from_ms([event.visible_at_ms for event in events]),
        pa.array([event.group_id or None for event in events], type=pa.string()),
        pa.array([event.reason or None for event in events], type=pa.string()),
        pa.array([event.source_queue or None for event in events], type=pa.string()),
        pa.array([e.count if e.type == _PURGED else None for e in events], type=pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=journal_arrow_schema())


def message_batch_from_proto(
    queue: str,
    messages: Sequence[export_pb2.ExportedMessage],
    *,
    snapshot_log_index: int,
    include_body: bool,
) -> pa.RecordBatch:
    count = len(messages)
    bodies = [message.body for message in messages] if include_body else [None] * count
    columns = [
        pa.array([queue] * count, type=pa.string()),
        pa.array([message.shard for message in messages], type=pa.int32()),
        pa.array([message.seq for message in messages], type=pa.int64()),
        pa.array([message.message_id for message in messages], type=pa.string()),
        pa.array([MESSAGE_STATE_NAMES.get(message.state, "UNSPECIFIED") for message in messages], type=pa.string()),
        _timestamps_from_ms([message.sent_at_ms for message in messages]),
        _timestamps_from_ms([message.first_received_at_ms for message in messages]),
        _timestamps_from_ms([message.last_received_at_ms for message in messages]),
        _timestamps_from_ms([message.visible_at_ms for message in messages]),
        pa.array([message.receive_count for message in messages], type=pa.int32()),
        pa.array([message.size for message in messages], type=pa.int32()),
        pa.array([list(message.attributes.items()) for message in messages], type=pa.map_(pa.string(), pa.string())),
        pa.array([message.group_id or None for message in messages], type=pa.string()),
        pa.array([message.dedup_id or None for message in messages], type=pa.string()),
        pa.array(bodies, type=pa.binary()),
        pa.array([snapshot_log_index] * count, type=pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=messages_arrow_schema())
