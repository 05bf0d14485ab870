"""Closing an LMDB environment only once no thread is inside it.

py-lmdb frees every transaction and cursor of an environment when it closes,
and LMDB calls run without the GIL: a worker thread still walking a cursor
then reads freed memory and the process dies with SIGSEGV. Every use of a
shard environment enters this gate; `close` refuses new users, asks the
long-lived holders (a snapshot export between two batches) to let go, and
waits for everyone inside to leave before the environment is really closed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shardq.errors import Unavailable

log = logging.getLogger(__name__)

# How often a close that waits for a long operation (a snapshot copy) says so.
WAIT_NOTICE_S = 5.0


class EnvironmentClosed(Unavailable):
    """The shard's environment closed (shutdown, or replaced by a snapshot): retry."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is closing or was replaced; retry the call")


class CloseGate:
    def __init__(self, what: str) -> None:
        self.what = what
        self._condition = threading.Condition()
        self._users = 0
        self._closing = False
        self._holders: dict[int, Callable[[], None]] = {}

    @property
    def closed(self) -> bool:
        return self._closing

    def enter(self) -> None:
        with self._condition:
            if self._closing:
                raise EnvironmentClosed(self.what)
            self._users += 1

    def leave(self) -> None:
        with self._condition:
            self._users -= 1
            self._condition.notify_all()

    @contextmanager
    def entered(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def hold(self, token: int, let_go: Callable[[], None]) -> None:
        """Register a user that stays inside between calls; `let_go` makes it leave soon."""
        with self._condition:
            self._holders[token] = let_go

    def unhold(self, token: int) -> None:
        with self._condition:
            self._holders.pop(token, None)

    def close(self, close_environment: Callable[[], None]) -> None:
        """Refuse new users, wait until the last one leaves, then close (idempotent)."""
        with self._condition:
            if self._closing:
                return
            self._closing = True
            holders = list(self._holders.values())
        for let_go in holders:
            let_go()
        with self._condition:
            while self._users:
                if not self._condition.wait(timeout=WAIT_NOTICE_S):
                    log.warning("%s: waiting for %d reader(s) to finish before closing", self.what, self._users)
            close_environment()
