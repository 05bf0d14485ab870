"""Which asyncio event loop runs the server and the blocking client: uvloop where it is installed.

A call's time at one call in flight is mostly gRPC's asyncio integration, not the commit:
each unary call takes several event-loop turns on both ends, and grpc.aio wakes the loop
from its poller thread through a socket pair. On the 2-core machines this project is
measured on, a bare gRPC health check took 0.66 ms p50 with asyncio's loop on both ends
and 0.46 ms with uvloop on both (server CPU per call 400 -> 280 µs, client 310 -> 220 µs);
see bench/LATENCY.md. uvloop is a dependency wherever it builds (CPython,
not Windows); `asyncio` stays selectable, and `auto` falls back to it when uvloop is missing.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

AUTO = "auto"
UVLOOP = "uvloop"
ASYNCIO = "asyncio"
CHOICES = (AUTO, UVLOOP, ASYNCIO)
# The blocking Client has no command line: its loop comes from the environment.
ENVIRONMENT_VARIABLE = "SHARDQ_EVENT_LOOP"


class EventLoopUnavailable(ValueError):
    """The loop asked for cannot be used here (a name we do not know, or uvloop not installed)."""


def resolve(choice: str) -> str:
    """The loop `choice` stands for on this machine: `auto` is uvloop when importable."""
    if choice not in CHOICES:
        raise EventLoopUnavailable(f"unknown event loop {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == ASYNCIO:
        return ASYNCIO
    try:
        importlib.import_module("uvloop")
    except ImportError:
        if choice == UVLOOP:
            raise EventLoopUnavailable(
                "event loop 'uvloop' asked for but uvloop is not installed (pip install uvloop, or use 'asyncio')"
            ) from None
        return ASYNCIO
    return UVLOOP


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for `asyncio.Runner(loop_factory=...)` or a loop thread of one's own."""
    if resolve(choice) == UVLOOP:
        uvloop: Any = importlib.import_module("uvloop")
        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return factory
    return asyncio.new_event_loop


def name_of(loop: asyncio.AbstractEventLoop) -> str:
    """`uvloop` or `asyncio`: which kind of loop this is (for logs and results)."""
    return type(loop).__module__.split(".")[0]


def from_environment() -> str:
    """The choice in SHARDQ_EVENT_LOOP (default `auto`), for code without a command line."""
    return os.environ.get(ENVIRONMENT_VARIABLE, AUTO).strip().lower() or AUTO


def run(main: Coroutine[Any, Any, T], *, choice: str = AUTO) -> T:
    """`asyncio.run` on the chosen loop."""
    try:
        factory = loop_factory(choice)
    except EventLoopUnavailable:
        main.close()  # never started: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
