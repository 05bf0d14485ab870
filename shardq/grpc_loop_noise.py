"""Quieting grpc.aio's known noise when a process uses more than one event loop.

grpc.aio has one poller for the process, and it wakes the loops it served through a
socket. After `asyncio.run(...)` with an AsyncClient has ended, a blocking Client (its own
loop thread) got "Exception in callback PollerCompletionQueue._handle_events ...
RuntimeError: Event loop is closed" tracebacks on stderr, and with loops in several
threads BlockingIOError ones, while every call worked (grpc/grpc#25364, #34139). The
blocking Client's loop ignores exactly those; anything else goes to the default handler.
"""

from __future__ import annotations

import asyncio
from typing import Any

_POLLER_CALLBACK = "PollerCompletionQueue._handle_events"


def is_grpc_poller_noise(context: dict[str, Any]) -> bool:
    exception = context.get("exception")
    spurious = isinstance(exception, BlockingIOError) or (
        isinstance(exception, RuntimeError) and str(exception) == "Event loop is closed"
    )
    return spurious and _POLLER_CALLBACK in repr(context.get("handle", ""))


def ignore_grpc_poller_noise(loop: asyncio.AbstractEventLoop) -> None:
    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not is_grpc_poller_noise(context):
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
