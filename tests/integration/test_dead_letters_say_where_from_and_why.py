"""A dead-lettered copy says where it came from, why, and the last error its handlers
gave when releasing it; senders cannot forge those notes, and a redrive leaves them
behind."""

from __future__ import annotations

import asyncio

import pytest

from shardq import AsyncClient, Client, InvalidArgument, Message, run_consumer
from shardq.types import ReceivedMessage
from tests.support.servers import ServerFactory, ServerProcess, wait_for

QUEUES = ("jobs:dead_letter_queue=jobs-dlq,max_receive_count=2", "jobs-dlq")


def wait_for_dead_letter(client: Client) -> ReceivedMessage:
    found: list[ReceivedMessage] = []

    def arrived() -> bool:
        client.receive_messages("jobs", max_messages=10)  # the receive past the limit dead-letters
        found.extend(client.receive_messages("jobs-dlq", max_messages=10, visibility_timeout_ms=60_000))
        return bool(found)

    wait_for(arrived, timeout=30, what="the dead-letter copy")
    (copy,) = found
    return copy


def test_a_dead_letter_copy_carries_source_reason_and_last_error(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)
    with Client(server.endpoint) as client:
        client.send_messages("jobs", [Message(b"job", {"customer": "17"})])
        for attempt in (1, 2):
            (message,) = client.receive_messages("jobs", max_messages=1, visibility_timeout_ms=60_000)
            (released,) = client.release_messages(
                "jobs", [message.receipt], reason=f"timeout talking to db ({attempt})"
            )
            assert released.ok
            wait_for(lambda: client.attributes("jobs").visible == 1, timeout=10, what="the backoff to pass")
        server.restart()  # the last error is stored with the message, not in memory
    with Client(server.endpoint) as client:
        copy = wait_for_dead_letter(client)
    assert copy.body == b"job"
    assert copy.attributes["customer"] == "17"
    assert copy.attributes["shardq.dead_letter.source_queue"] == "jobs"
    assert "max_receive_count 2" in copy.attributes["shardq.dead_letter.reason"]
    assert copy.attributes["shardq.dead_letter.last_error"] == "timeout talking to db (2)"

    with Client(server.endpoint) as client:
        client.delete_messages("jobs-dlq", [copy.receipt])


def test_run_consumer_releases_with_the_handlers_error(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)

    async def failing_consumer() -> None:
        async with AsyncClient(server.endpoint) as client:
            await client.send_messages("jobs", [Message(b"poison")])

            def handler(message: ReceivedMessage) -> None:
                raise ValueError("bad input: no customer id")

            stop = asyncio.Event()
            consumer = asyncio.create_task(
                run_consumer(client, "jobs", handler, concurrency=1, stop=stop, handle_signals=False)
            )
            for _ in range(200):
                if (await client.attributes("jobs-dlq")).visible:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await consumer

    asyncio.run(failing_consumer())
    with Client(server.endpoint) as client:
        (copy,) = client.receive_messages("jobs-dlq", max_messages=10)
    assert copy.attributes["shardq.dead_letter.last_error"] == "ValueError: bad input: no customer id"


def test_senders_cannot_forge_the_notes_and_redrive_leaves_them_behind(server_factory: ServerFactory) -> None:
    server = server_factory(*QUEUES)
    with Client(server.endpoint) as client:
        with pytest.raises(InvalidArgument, match="reserved for shardq"):
            client.send_messages("jobs", [Message(b"x", {"shardq.dead_letter.reason": "forged"})])
        client.send_messages("jobs", [Message(b"again", {"k": "v"})])
        for _ in range(2):
            (message,) = client.receive_messages("jobs", max_messages=1, visibility_timeout_ms=60_000)
            client.release_messages("jobs", [message.receipt], reason="nope")
            wait_for(lambda: client.attributes("jobs").visible == 1, timeout=10, what="the backoff to pass")
        copy = wait_for_dead_letter(client)
        client.release_messages("jobs-dlq", [copy.receipt])
        wait_for(lambda: client.attributes("jobs-dlq").visible == 1, timeout=10, what="the copy visible again")
        assert list(client.redrive(source="jobs-dlq", destination="jobs"))[-1].moved == 1
        (back,) = client.receive_messages("jobs", max_messages=1, wait_time_ms=5_000)
    assert back.attributes == {"k": "v"}


def test_a_reason_longer_than_1024_characters_is_refused(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.send_messages("orders", [Message(b"m")])
        (message,) = client.receive_messages("orders", max_messages=1, wait_time_ms=5_000)
        with pytest.raises(InvalidArgument, match="at most 1024 characters"):
            client.release_messages("orders", [message.receipt], reason="x" * 1025)
