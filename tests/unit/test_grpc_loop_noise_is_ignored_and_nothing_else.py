"""The blocking Client's loop drops grpc.aio's spurious poller errors and nothing else.

The noise itself depends on when a completion for an ended loop arrives, so the
integration test (test_both_clients_in_one_process_print_no_tracebacks) does not always
provoke it; this checks the filter with the contexts asyncio builds for it."""

from __future__ import annotations

import asyncio
import functools
import logging

import pytest

from shardq.grpc_loop_noise import ignore_grpc_poller_noise


class PollerCompletionQueue:  # named as grpc's, whose bound method the handle holds
    def _handle_events(self, loop: object) -> None: ...


def context_for(exception: BaseException, callback: object) -> dict[str, object]:
    loop = asyncio.new_event_loop()
    try:
        handle = asyncio.Handle(callback, (), loop)  # type: ignore[arg-type]
    finally:
        loop.close()
    return {"message": "Exception in callback", "exception": exception, "handle": handle}


@pytest.mark.parametrize(
    ("exception", "from_poller", "shown"),
    [
        (RuntimeError("Event loop is closed"), True, False),
        (BlockingIOError(11, "Resource temporarily unavailable"), True, False),
        (RuntimeError("Event loop is closed"), False, True),
        (ValueError("a real bug"), True, True),
    ],
)
def test_only_the_pollers_spurious_errors_are_dropped(
    exception: BaseException, from_poller: bool, shown: bool, caplog: pytest.LogCaptureFixture
) -> None:
    callback = functools.partial(PollerCompletionQueue()._handle_events, None) if from_poller else (lambda: None)
    loop = asyncio.new_event_loop()
    try:
        ignore_grpc_poller_noise(loop)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop.call_exception_handler(context_for(exception, callback))
    finally:
        loop.close()
    assert bool(caplog.records) == shown
