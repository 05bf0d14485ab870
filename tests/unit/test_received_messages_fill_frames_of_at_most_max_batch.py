"""A receive's messages go out in frames of at most max_batch (a consume stream's frames),
each message once, in the order claimed, with what other leaders claimed after them; a
shared receive's answer says how many of its messages are each share's."""

from __future__ import annotations

from typing import Any, cast

from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord
from shard_server.domain.receiving import ClaimedMessage
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.hosting import Received
from shard_server.service.converting import received_frames, shared_received_to_proto
from shardq.api.v1 import queue_pb2
from shardq.receipts import Receipt, decode_receipt


class Shard:
    def __init__(self, index: int) -> None:
        self.index = index


def claimed(shard: int, seq: int, *, group: str = "") -> tuple[HostedShard, ClaimedMessage]:
    record = MessageRecord(seq, 1_000 + seq, b"body-%d" % seq, {"n": str(seq)} if seq % 2 else {}, group, "")
    delivery = Delivery(seq, DeliveryState.CLAIMED, 1_000 + seq, 9_000, 2, 1_500, 1_600, 3, 7)
    return cast(HostedShard, Shard(shard)), ClaimedMessage(record, delivery, Receipt(11, shard, seq, 3, 7))


def consume_frame() -> tuple[queue_pb2.ConsumeResponse, queue_pb2.ReceiveMessagesResponse]:
    response = queue_pb2.ConsumeResponse()
    return response, response.messages


def test_messages_fill_frames_of_at_most_max_batch_in_order() -> None:
    forwarded = queue_pb2.ReceivedMessage(message_id="from-another-leader", body=b"remote")
    received = Received([claimed(2, seq) for seq in range(1, 8)], [forwarded])
    frames = received_frames(received, 3, consume_frame)
    assert [len(frame.messages.messages) for frame in frames] == [3, 3, 2]
    messages: list[Any] = [message for frame in frames for message in frame.messages.messages]
    assert [message.seq for message in messages[:7]] == list(range(1, 8))
    assert messages[7] == forwarded
    first = messages[0]
    assert (first.body, dict(first.attributes), first.group_id, first.shard) == (b"body-1", {"n": "1"}, "", 2)
    assert (first.receive_count, first.sent_at_ms, first.first_received_at_ms, first.visible_until_ms) == (
        2,
        1_001,
        1_500,
        9_000,
    )
    assert decode_receipt(first.receipt) == Receipt(11, 2, 1, 3, 7)
    assert dict(messages[1].attributes) == {}


def test_a_full_last_frame_is_not_followed_by_an_empty_one() -> None:
    frames = received_frames(Received([claimed(0, seq) for seq in range(1, 7)], []), 3, consume_frame)
    assert [len(frame.messages.messages) for frame in frames] == [3, 3]
    assert received_frames(Received([], []), 3, consume_frame) == []


def test_a_shared_answer_counts_each_shares_messages() -> None:
    parts = [
        Received([claimed(1, 1), claimed(1, 2, group="g")], []),
        Received([], []),
        Received([claimed(3, 9)], [queue_pb2.ReceivedMessage(message_id="remote")]),
    ]
    response = shared_received_to_proto(parts)
    assert list(response.share_counts) == [2, 0, 2]
    assert [message.seq for message in response.messages] == [1, 2, 9, 0]
    assert response.messages[1].group_id == "g"
    assert response.messages[3].message_id == "remote"
