"""A process that opens and closes blocking Clients one after another keeps one event
loop, not one per Client ever made.

grpc.aio holds on to every event loop it served for the life of the process, so a loop
closed with its Client stayed in memory: 100 Clients opened and closed in turn grew a
process from 44 to 70 MiB (about 250 KiB per uvloop loop). A closed Client's loop now
serves the next Client; Clients open at the same time still get loops of their own.
Real server, real gRPC."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from shardq import Client, Message
from tests.support.servers import ServerProcess

CYCLES = 40


def live_event_loops() -> int:
    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, asyncio.AbstractEventLoop))


def client_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "shardq-client"}


def test_clients_opened_and_closed_in_turn_leave_no_event_loop_behind(server: ServerProcess) -> None:
    with Client(server.endpoint) as warm:
        warm.send_messages("orders", [Message(b"warm-up")])
    loops_before, threads_before = live_event_loops(), client_threads()
    for index in range(CYCLES):
        with Client(server.endpoint) as client:
            (sent,) = client.send_messages("orders", [Message(f"m{index}".encode())])
            assert sent.ok
    assert live_event_loops() == loops_before
    assert client_threads() == threads_before


def test_clients_open_at_once_each_run_on_a_loop_of_their_own(server: ServerProcess) -> None:
    with Client(server.endpoint) as first, Client(server.endpoint) as second:
        assert first._loop is not second._loop
        first.send_messages("orders", [Message(b"a")])
        second.send_messages("orders", [Message(b"b")])
    # Both loops are kept, and the next Client made runs on one of them, with nothing
    # of the closed Clients' left on it.
    with Client(server.endpoint) as third:
        assert third._loop in {first._loop, second._loop}
        pending = asyncio.run_coroutine_threadsafe(_other_tasks(), third._loop).result(timeout=5)
        assert pending == []
        assert third.attributes("orders").visible >= 2
    # A closed Client says so, though its loop runs on for the next one.
    with pytest.raises(RuntimeError, match="this Client is closed"):
        first.attributes("orders")


async def _other_tasks() -> list[asyncio.Task[object]]:
    current = asyncio.current_task()
    return [task for task in asyncio.all_tasks() if task is not current]
