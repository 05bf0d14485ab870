"""Polling with a deadline: the only way the e2e tests wait for the cluster to converge."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
    retry_on: tuple[type[Exception], ...] = (),
    check: Callable[[], None] | None = None,
    explain: Callable[[], str] | None = None,
) -> T:
    """Call `probe` until it returns something other than None or False, and return that.

    Exceptions of the `retry_on` types count as "not yet"; any other propagates at once.
    `check` runs before every probe and may raise to stop waiting early (for example when
    a control-plane process has died). Raises TimeoutError naming `what` after `timeout`
    seconds, with the last retried exception, if any, as its cause, and what `explain`
    returns then (the state at the timeout, not at the start of the wait).
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        if check is not None:
            check()
        try:
            result = probe()
        except retry_on as error:
            last_error = error
        else:
            if result is not None and result is not False:
                return result
            last_error = None
        if time.monotonic() >= deadline:
            details = f"\n{explain()}" if explain is not None else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{details}") from last_error
        time.sleep(interval)
