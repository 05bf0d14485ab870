"""Long-lived streams a client keeps by key (queue and leader, or leader), opened on first
use and dropped when they fail: what shardq.ack_streams and shardq.send_streams carry
their requests on instead of unary calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Protocol, TypeVar


class Stream(Protocol):
    @property
    def ended(self) -> bool:
        """Nothing sent on it now would be answered (it ended or broke)."""
        ...

    async def close(self) -> object: ...


Key = TypeVar("Key", bound=Hashable)
S = TypeVar("S", bound=Stream)


class StreamPool(Generic[Key, S]):
    """One open stream per key (event loop only)."""

    def __init__(self, open_stream: Callable[[Key], Awaitable[S]]) -> None:
        self._open_stream = open_stream
        self._streams: dict[Key, S] = {}
        # Streams being opened: concurrent first requests share one.
        self._opening: dict[Key, asyncio.Future[S]] = {}
        self._dropped: set[asyncio.Future[object]] = set()

    async def get(self, key: Key) -> S:
        """The key's open stream, opened now if it has none or the one it had ended."""
        stream = self._streams.get(key)
        if stream is not None and not stream.ended:
            return stream
        if stream is not None:
            self.drop(key, stream)
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.ensure_future(self._open_stream(key))
            opening.add_done_callback(lambda done: self._opened(key, done))
        return await asyncio.shield(opening)

    def _opened(self, key: Key, done: asyncio.Future[S]) -> None:
        self._opening.pop(key, None)
        if not done.cancelled() and done.exception() is None:
            self._streams[key] = done.result()

    def drop(self, key: Key, stream: S) -> None:
        """Forget `stream` (it failed) and close it: requests still on it are answered if
        its server answers them, and the key's next request opens another."""
        if self._streams.get(key) is stream:
            del self._streams[key]
        closing = asyncio.ensure_future(stream.close())
        self._dropped.add(closing)
        closing.add_done_callback(self._dropped.discard)

    async def close(self) -> None:
        """Close every stream (before the channels under them close)."""
        for opening in list(self._opening.values()):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await opening
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.close()
        if self._dropped:
            await asyncio.wait(set(self._dropped), timeout=5)
