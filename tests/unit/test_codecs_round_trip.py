"""Binary layouts round-trip exactly, and damaged input is refused, not guessed at."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard_server.domain.events import ChangeKind, DeliveryChanged, LogEntry, Purged, RemovalKind, Removed, Sent
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord, format_message_id, parse_message_id
from shard_server.storage.codecs import (
    CorruptEntry,
    decode_delivery,
    decode_entry,
    decode_event,
    decode_record,
    encode_delivery,
    encode_entry,
    encode_event,
    encode_record,
)
from shardq.queues import MAX_PRIORITY_LANES
from shardq.receipts import MalformedReceipt, Receipt, decode_receipt, encode_receipt

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
records = st.builds(
    MessageRecord,
    seq=st.integers(1, 2**63),
    sent_at_ms=st.integers(0, 2**62),
    body=st.binary(max_size=300),
    attributes=st.dictionaries(text.filter(bool), text, max_size=5),
    group_id=text,
    dedup_id=text,
    source_queue=text,
)
deliveries = st.builds(
    Delivery,
    seq=st.integers(1, 2**63),
    state=st.sampled_from(DeliveryState),
    sent_at_ms=st.integers(0, 2**62),
    visible_at_ms=st.integers(0, 2**62),
    receive_count=st.integers(0, 2**31),
    first_received_at_ms=st.integers(0, 2**62),
    last_received_at_ms=st.integers(0, 2**62),
    claim_epoch=st.integers(0, 2**63),
    claim_token=st.integers(0, 2**63),
    last_error=text,
    priority=st.integers(0, MAX_PRIORITY_LANES - 1),
)


@given(records, deliveries, st.integers(0, 2**62))
def test_sent_event_round_trips(record: MessageRecord, delivery: Delivery, expires: int) -> None:
    delivery = Delivery(record.seq, *[getattr(delivery, f) for f in Delivery.__dataclass_fields__ if f != "seq"])
    event = Sent(record, delivery, expires)
    assert decode_event(encode_event(event)) == event


@given(deliveries, text, st.sampled_from(ChangeKind))
def test_delivery_change_round_trips(delivery: Delivery, reason: str, kind: ChangeKind) -> None:
    event = DeliveryChanged(kind, delivery, reason)
    assert decode_event(encode_event(event)) == event


@given(st.integers(1, 2**63), st.integers(0, 2**62), st.binary(max_size=300))
def test_plain_record_round_trips_through_the_short_path(seq: int, sent_at: int, body: bytes) -> None:
    # No attributes or ids: encode and decode take their short path, whose bytes
    # must be exactly the general layout's.
    record = MessageRecord(seq, sent_at, body, {}, "", "", "")
    general = encode_record(MessageRecord(seq, sent_at, body, {"k": "v"}, "", "", ""))
    encoded = encode_record(record)
    assert decode_record(encoded) == record
    assert encoded[:10] == general[:10]  # same seq and sent_at header fields
    assert decode_record(memoryview(encoded)) == record


def test_truncated_plain_record_is_refused() -> None:
    encoded = encode_record(MessageRecord(1, 2, b"body", {}, "", "", ""))
    with pytest.raises(CorruptEntry, match="body"):
        decode_record(encoded[:-1])


def test_unknown_delivery_state_is_refused() -> None:
    encoded = bytearray(encode_delivery(Delivery(7, DeliveryState.READY, 1, 1)))
    encoded[0] = 0x0E  # the state is the byte's low four bits
    with pytest.raises(CorruptEntry, match="delivery state 14"):
        decode_delivery(7, bytes(encoded))
    encoded[0] = MAX_PRIORITY_LANES << 4  # the priority its high four
    with pytest.raises(CorruptEntry, match=f"priority {MAX_PRIORITY_LANES}"):
        decode_delivery(7, bytes(encoded))


def test_a_delivery_of_lane_0_is_encoded_as_before_lanes_and_others_keep_their_lane() -> None:
    """Stored data from before priority lanes reads as lane 0, unchanged."""
    delivery = Delivery(7, DeliveryState.CLAIMED, 1, 2, 3, 4, 5, 6, 7, "why")
    before_lanes = struct.pack(">BIqqqqQQ", 1, 3, 1, 2, 4, 5, 6, 7) + b"why"
    assert encode_delivery(delivery) == before_lanes
    assert decode_delivery(7, before_lanes) == delivery
    high = dataclasses.replace(delivery, priority=9)
    assert encode_delivery(high)[0] == 0x91
    assert decode_delivery(7, encode_delivery(high)) == high


def test_log_entry_round_trips() -> None:
    events = (Removed(RemovalKind.EXPIRED, 5, 77), Purged(9, 3))
    data = encode_entry(epoch=3, index=11, at_ms=99, encoded_events=[encode_event(e) for e in events])
    assert decode_entry(data) == LogEntry(3, 11, 99, events)


def test_unknown_layout_is_refused() -> None:
    data = bytearray(encode_entry(epoch=1, index=1, at_ms=1, encoded_events=[]))
    data[0] = 99
    with pytest.raises(CorruptEntry):
        decode_entry(bytes(data))


@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)
def test_receipt_round_trips(fingerprint: int, shard: int, seq: int, epoch: int, token: int) -> None:
    receipt = Receipt(fingerprint, shard, seq, epoch, token)
    assert decode_receipt(encode_receipt(receipt)) == receipt


def test_receipts_keep_their_encoding() -> None:
    """Receipts handed out before an upgrade must stay valid after it: the text of a
    receipt, url-safe base64 with '-' and '_', is fixed."""
    assert encode_receipt(Receipt(1, 2, 3, 4, 5)) == "AQAAAAEAAgAAAAAAAAADAAAAAAAAAAQAAAAAAAAABecYh3o="
    largest = Receipt(2**32 - 1, 2**16 - 1, 2**64 - 1, 2**64 - 2, 2**64 - 3)
    assert encode_receipt(largest) == "Af____________________________7__________TxrkjY="


def test_damaged_receipts_are_malformed() -> None:
    good = encode_receipt(Receipt(1, 2, 3, 4, 5))
    flipped = good[:10] + ("A" if good[10] != "A" else "B") + good[11:]
    for bad in ("", "x" * len(good), good[:-2], flipped, good + "=="):
        with pytest.raises(MalformedReceipt):
            decode_receipt(bad)


@given(st.integers(0, 2**48 - 1), st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1))
def test_message_ids_sort_by_time_and_parse_back(sent_at: int, shard: int, seq: int) -> None:
    message_id = format_message_id(sent_at_ms=sent_at, shard=shard, seq=seq)
    assert parse_message_id(message_id) == (sent_at, shard, seq)
    later = format_message_id(sent_at_ms=sent_at + 1, shard=0, seq=0)
    assert later > message_id or sent_at + 1 >= 2**48
