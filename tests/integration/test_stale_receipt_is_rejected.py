"""Invariant 2: only the current claim's receipt, before its deadline, acts on a message."""

from __future__ import annotations

import time

from shardq import Client, Message, Reason
from shardq.receipts import decode_receipt, encode_receipt
from tests.support.servers import ServerProcess, stored_count, wait_for, wait_in_flight

QUEUE = "orders-dlq"  # one shard, no dead-letter queue of its own


def now_ms() -> int:
    return int(time.time() * 1000)


def test_expired_then_stale_receipt_is_rejected_and_changes_nothing(client: Client) -> None:
    (sent,) = client.send_messages(QUEUE, [Message(b"stale")])
    (first,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=300)
    assert first.message_id == sent.message_id
    wait_for(lambda: now_ms() > first.visible_until_ms + 20, timeout=5, what="the visibility timeout to pass")

    (expired,) = client.delete_messages(QUEUE, [first.receipt])
    assert (expired.ok, expired.reason) == (False, Reason.RECEIPT_EXPIRED)
    (expired_change,) = client.change_visibility(QUEUE, [(first.receipt, 60_000)])
    assert (expired_change.ok, expired_change.reason) == (False, Reason.RECEIPT_EXPIRED)
    assert stored_count(client, QUEUE) == 1

    (second,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
    assert second.message_id == first.message_id
    assert second.receive_count == 2
    assert second.receipt != first.receipt

    for results in (
        client.delete_messages(QUEUE, [first.receipt]),
        client.change_visibility(QUEUE, [(first.receipt, 0)]),
        client.release_messages(QUEUE, [first.receipt]),
    ):
        assert [(r.ok, r.reason) for r in results] == [(False, Reason.STALE_RECEIPT)]
    # Nothing changed: still in flight with the second claim, invisible to others.
    attributes = client.attributes(QUEUE)
    assert (attributes.visible, attributes.in_flight) == (0, 1)
    assert client.receive_messages(QUEUE, max_messages=10) == []

    (deleted,) = client.delete_messages(QUEUE, [second.receipt])
    assert deleted.ok
    assert stored_count(client, QUEUE) == 0
    (gone,) = client.delete_messages(QUEUE, [second.receipt])
    assert not gone.ok
    assert gone.reason == Reason.MESSAGE_NOT_FOUND


def test_forged_receipt_with_a_newer_claim_token_is_stale(client: Client) -> None:
    client.send_messages(QUEUE, [Message(b"forged")])
    (received,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
    real = decode_receipt(received.receipt)
    forged = encode_receipt(type(real)(real.queue_fingerprint, real.shard, real.seq, real.epoch, real.claim_token + 1))
    (result,) = client.delete_messages(QUEUE, [forged])
    assert (result.ok, result.reason) == (False, Reason.STALE_RECEIPT)
    assert client.attributes(QUEUE).in_flight == 1


def test_malformed_receipts_are_rejected(client: Client) -> None:
    client.send_messages(QUEUE, [Message(b"malformed")])
    (received,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
    wait_in_flight(client, QUEUE, 1)
    flipped = received.receipt[:5] + ("A" if received.receipt[5] != "A" else "B") + received.receipt[6:]
    bad = ["", "not-a-receipt", received.receipt[:-2], flipped, "!" * len(received.receipt)]
    results = client.delete_messages(QUEUE, bad)
    assert [(r.ok, r.reason) for r in results] == [(False, Reason.MALFORMED_RECEIPT)] * len(bad)
    attributes = client.attributes(QUEUE)
    assert (attributes.visible, attributes.in_flight) == (0, 1)
    (ok,) = client.delete_messages(QUEUE, [received.receipt])
    assert ok.ok


def test_receipt_from_another_queue_is_rejected(server: ServerProcess, client: Client) -> None:
    client.send_messages(QUEUE, [Message(b"elsewhere")])
    (received,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
    wait_in_flight(client, QUEUE, 1)
    for other in ("orders", "fifo"):
        results = client.delete_messages(other, [received.receipt])
        assert [(r.ok, r.reason) for r in results] == [(False, Reason.WRONG_QUEUE)], other
    # A receipt for shard 3 of `orders` names a shard `fifo` (2 shards) does not have.
    for i in range(8):  # one call each: calls rotate over the shards
        client.send_messages("orders", [Message(str(i).encode())])
    from_orders = client.receive_messages("orders", max_messages=8, visibility_timeout_ms=60_000)
    assert len(from_orders) == 8
    wait_in_flight(client, "orders", 8)
    high = [m for m in from_orders if m.shard >= 2]
    assert high
    results = client.delete_messages("fifo", [m.receipt for m in high])
    assert {(r.ok, r.reason) for r in results} == {(False, Reason.WRONG_QUEUE)}
    assert client.attributes(QUEUE).in_flight == 1
    assert client.attributes("orders").in_flight == 8
