"""Beyond SQS: delays over 15 minutes and visibility over 12 hours, up to the retention period."""

from __future__ import annotations

import time

from shardq import Client, Message

QUEUE = "orders-dlq"  # default retention: four days
TWENTY_MINUTES_MS = 20 * 60_000
THIRTEEN_HOURS_MS = 13 * 3_600_000


def test_twenty_minute_delay_is_accepted_and_delays(client: Client) -> None:
    (sent,) = client.send_messages(QUEUE, [Message(b"later", delay_ms=TWENTY_MINUTES_MS)])
    assert sent.ok
    attributes = client.attributes(QUEUE)
    assert (attributes.visible, attributes.delayed) == (0, 1)
    assert client.receive_messages(QUEUE, max_messages=10) == []


def test_thirteen_hour_visibility_is_accepted(client: Client) -> None:
    client.send_messages(QUEUE, [Message(b"slow job")])
    before_ms = int(time.time() * 1000)
    (received,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=THIRTEEN_HOURS_MS)
    after_ms = int(time.time() * 1000)
    assert before_ms + THIRTEEN_HOURS_MS - 1_000 <= received.visible_until_ms <= after_ms + THIRTEEN_HOURS_MS + 1_000
    (extended,) = client.change_visibility(QUEUE, [(received.receipt, 2 * THIRTEEN_HOURS_MS)])
    assert extended.ok
    assert client.attributes(QUEUE).in_flight == 1
    assert client.receive_messages(QUEUE, max_messages=10) == []
