"""How much a stream has read and not yet answered on the wire, and a wait for room.

A stream's handler once read every request its client sent and queued the answers
without bound: a client that wrote requests and never read the answers grew the server
by the size of everything answered (hundreds of MB in seconds, found by an adversarial
client). Counting each request from the moment it is read until its answer is written
lets the handler stop reading while the count is at its limit; HTTP/2 flow control then
holds the client back, and the server keeps only the limit's worth.
"""

from __future__ import annotations

import asyncio


class Unwritten:
    """Frames a stream has taken on (requests read, messages claimed to push) whose
    answers are not yet written. `room()` waits until fewer than `limit` are."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._count = 0
        self._has_room = asyncio.Event()
        self._has_room.set()

    def add(self, frames: int = 1) -> None:
        self._count += frames
        if self._count >= self._limit:
            self._has_room.clear()

    def written(self) -> None:
        self._count -= 1
        if self._count < self._limit:
            self._has_room.set()

    async def room(self) -> None:
        if self._count >= self._limit:
            await self._has_room.wait()
