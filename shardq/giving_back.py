"""Making claimed messages visible again now, or later, in calls the server takes:
the one give-back of run_consumer's prefetch and of a consumer stream's untaken messages.

Its own module because both `shardq.aio` (consume streams) and `shardq.consumer`
(run_consumer, which imports `shardq.aio`) use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from shardq.errors import ShardqError
from shardq.types import EntryResult, ReceivedMessage

log = logging.getLogger(__name__)

# The server's limit on receipts in one call.
MAX_RECEIPTS_PER_CALL = 1_000


class ChangesVisibility(Protocol):
    """What is needed of a client (`AsyncClient`)."""

    async def change_visibility(self, queue: str, changes: Sequence[tuple[str, int]]) -> list[EntryResult]: ...


async def change_visibility_in_chunks(
    client: ChangesVisibility, queue: str, receipts: list[str], visibility_ms: int, what: str
) -> list[tuple[str, EntryResult]]:
    """Set the visibility of prefetched messages, in calls of at most the server's limit;
    the results of the calls that were answered (a failed call is logged, as `what`)."""
    answered: list[tuple[str, EntryResult]] = []
    for start in range(0, len(receipts), MAX_RECEIPTS_PER_CALL):
        chunk = receipts[start : start + MAX_RECEIPTS_PER_CALL]
        try:
            results = await client.change_visibility(queue, [(receipt, visibility_ms) for receipt in chunk])
        except ShardqError as error:
            log.warning("could not %s %d prefetched messages: %s", what, len(chunk), error)
            continue
        answered += zip(chunk, results, strict=True)
    return answered


async def give_back_now(client: ChangesVisibility, queue: str, messages: list[ReceivedMessage]) -> None:
    """Make claimed messages nobody will handle visible again now (visibility 0): those
    run_consumer prefetched and never started, and those a consumer stream left untaken."""
    receipts = [message.receipt for message in messages]
    # A failed call leaves its messages visible again after their timeout.
    results = await change_visibility_in_chunks(client, queue, receipts, 0, "give back")
    refused = sum(1 for _, result in results if not result.ok)
    if refused:
        log.warning("%d prefetched messages could not be given back: visible again after their timeout", refused)
