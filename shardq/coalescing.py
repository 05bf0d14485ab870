"""Folding many concurrent small requests into few large ones.

Every call that arrives while earlier batches are in flight (or in the same
event-loop turn) joins the next batch, so throughput rises with concurrency
without adding a timer's worth of latency to a lone caller. Used for single
sends and batches onto the producer stream, and for acknowledgements on the
consumer stream: the server's cost is per request far more than per message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    def __init__(
        self,
        submit: Callable[[list[Item]], Awaitable[Sequence[Result]]],
        *,
        max_batch: int,
        max_in_flight: int,
    ) -> None:
        self._submit = submit
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._in_flight = 0
        self._flush_scheduled = False

    def add(self, item: Item) -> asyncio.Future[Result]:
        return self.add_many([item])[0]

    def add_many(self, items: Sequence[Item]) -> list[asyncio.Future[Result]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Result]] = [loop.create_future() for _ in items]
        self._pending.extend(zip(items, futures, strict=True))
        if not self._flush_scheduled and self._in_flight < self._max_in_flight:
            # Let every call made in this loop turn join the batch first.
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return futures

    def _flush(self) -> None:
        self._flush_scheduled = False
        while self._pending and self._in_flight < self._max_in_flight:
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self._submit([item for item, _ in batch])
        except Exception as error:  # every caller of the batch gets the failure
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        finally:
            self._in_flight -= 1
            self._flush()
