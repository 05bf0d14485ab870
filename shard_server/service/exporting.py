"""The ExportService servicer: read-only snapshots and journal reads for analytics.

The work runs in worker threads, batch by batch, to keep the event loop free.
A message export holds one LMDB read transaction for the whole stream, so its
snapshot is consistent while producers and consumers go on; a journal read
needs no snapshot (log entries never change) and opens one per batch. A
client may cancel either at any moment, also while a worker is inside a
batch: no transaction is ever closed under a running worker (see
`storage.lmdb_store.HeldRead`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeAlias

import grpc

from shard_server.domain.client_access import Verb
from shard_server.domain.events import ChangeKind, DeliveryChanged, LogEntry, Purged, RemovalKind, Removed, Sent
from shard_server.domain.messages import Delivery, DeliveryState, MessageRecord, format_message_id
from shard_server.runtime.client_access import OPEN_ACCESS, ClientAccess
from shard_server.runtime.committing import wall_clock_ms
from shard_server.runtime.hosted_shards import HostedShard
from shard_server.runtime.queue_hosts import QueueHost
from shard_server.service.callers import admit
from shard_server.service.errors import abort_with
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.errors import InvalidArgument, ShardqError, Unavailable

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
DEFAULT_BATCH = 1_000
MAX_BATCH = 10_000

_TYPE_BY_CHANGE = {
    ChangeKind.RECEIVED: export_pb2.JOURNAL_EVENT_TYPE_RECEIVED,
    ChangeKind.VISIBILITY_CHANGED: export_pb2.JOURNAL_EVENT_TYPE_VISIBILITY_CHANGED,
    ChangeKind.RELEASED: export_pb2.JOURNAL_EVENT_TYPE_RELEASED,
    ChangeKind.DEAD_LETTERED: export_pb2.JOURNAL_EVENT_TYPE_DEAD_LETTERED,
}
_TYPE_BY_REMOVAL = {
    RemovalKind.DELETED: export_pb2.JOURNAL_EVENT_TYPE_DELETED,
    RemovalKind.EXPIRED: export_pb2.JOURNAL_EVENT_TYPE_EXPIRED,
    RemovalKind.DEAD_LETTER_DELIVERED: export_pb2.JOURNAL_EVENT_TYPE_DEAD_LETTER_DELIVERED,
}


def message_state(delivery: Delivery, now_ms: int) -> export_pb2.MessageState.ValueType:
    if delivery.state == DeliveryState.DEAD_LETTER_PENDING:
        return export_pb2.MESSAGE_STATE_DEAD_LETTER_PENDING
    if delivery.state == DeliveryState.CLAIMED and delivery.visible_at_ms > now_ms:
        return export_pb2.MESSAGE_STATE_IN_FLIGHT
    if delivery.state == DeliveryState.READY and delivery.visible_at_ms > now_ms:
        return export_pb2.MESSAGE_STATE_DELAYED
    return export_pb2.MESSAGE_STATE_VISIBLE


def exported_message(
    shard: int, record: MessageRecord, delivery: Delivery, *, include_body: bool, now_ms: int
) -> export_pb2.ExportedMessage:
    return export_pb2.ExportedMessage(
        shard=shard,
        seq=record.seq,
        message_id=format_message_id(sent_at_ms=record.sent_at_ms, shard=shard, seq=record.seq),
        body=record.body if include_body else b"",
        size=len(record.body),
        attributes=record.attributes,
        group_id=record.group_id,
        dedup_id=record.dedup_id,
        sent_at_ms=record.sent_at_ms,
        receive_count=delivery.receive_count,
        first_received_at_ms=delivery.first_received_at_ms,
        last_received_at_ms=delivery.last_received_at_ms,
        visible_at_ms=delivery.visible_at_ms,
        state=message_state(delivery, now_ms),
    )


def journal_events(shard: int, entry: LogEntry) -> Iterator[export_pb2.JournalEvent]:
    """Flatten one log entry into lifecycle events (dedup pruning is not one)."""
    for event in entry.events:
        if isinstance(event, Sent):
            record = event.record
            yield export_pb2.JournalEvent(
                log_index=entry.index,
                epoch=entry.epoch,
                at_ms=entry.at_ms,
                shard=shard,
                type=export_pb2.JOURNAL_EVENT_TYPE_SENT,
                seq=record.seq,
                message_id=format_message_id(sent_at_ms=record.sent_at_ms, shard=shard, seq=record.seq),
                sent_at_ms=record.sent_at_ms,
                size=len(record.body),
                visible_at_ms=event.delivery.visible_at_ms,
                group_id=record.group_id,
                source_queue=record.source_queue,
            )
        elif isinstance(event, DeliveryChanged):
            delivery = event.delivery
            yield export_pb2.JournalEvent(
                log_index=entry.index,
                epoch=entry.epoch,
                at_ms=entry.at_ms,
                shard=shard,
                type=_TYPE_BY_CHANGE[event.kind],
                seq=delivery.seq,
                message_id=format_message_id(sent_at_ms=delivery.sent_at_ms, shard=shard, seq=delivery.seq),
                sent_at_ms=delivery.sent_at_ms,
                receive_count=delivery.receive_count,
                visible_at_ms=delivery.visible_at_ms,
                reason=event.reason,
            )
        elif isinstance(event, Removed):
            yield export_pb2.JournalEvent(
                log_index=entry.index,
                epoch=entry.epoch,
                at_ms=entry.at_ms,
                shard=shard,
                type=_TYPE_BY_REMOVAL[event.kind],
                seq=event.seq,
                message_id=format_message_id(sent_at_ms=event.sent_at_ms, shard=shard, seq=event.seq),
                sent_at_ms=event.sent_at_ms,
            )
        elif isinstance(event, Purged):
            yield export_pb2.JournalEvent(
                log_index=entry.index,
                epoch=entry.epoch,
                at_ms=entry.at_ms,
                shard=shard,
                type=export_pb2.JOURNAL_EVENT_TYPE_PURGED,
                count=event.count,
            )


async def readable_last_index(shard: HostedShard, last_index: int) -> int:
    """The journal's last entry a reader may see: on a replicated shard, the last one every
    in-sync replica holds. An entry past it may still be lost in a failover, and an
    analytics job must not count events that then never happened. Right after a failover
    it waits (bounded) for what the new leader inherited to be known committed: a reader
    then is not shown a journal cut short."""
    if shard.replica is not None:
        return await shard.replica.readable_through(last_index)
    return last_index


def _batch_size(requested: int) -> int:
    if requested > MAX_BATCH:
        raise InvalidArgument("batch_size", f"at most {MAX_BATCH}")
    return requested or DEFAULT_BATCH


class ExportServicer(export_pb2_grpc.ExportServiceServicer):
    def __init__(
        self, host: QueueHost, *, credential: PeerCredential = NO_PEER_SECRET, access: ClientAccess = OPEN_ACCESS
    ) -> None:
        self.host = host
        self.credential = credential
        self.access = access

    async def _admit(self, context: Context, queue: str) -> None:
        if self.access.enforced:
            await admit(self.access, self.credential, context.invocation_metadata(), (Verb.EXPORT,), queue)

    def _queue_and_shard(self, queue_name: str, shard: int) -> HostedShard:
        """The shard to read, led here: in a cluster a server holds only some shards (by
        index, not by position), and a follower's copy may lag its leader's, so any other
        server answers NOT_LEADER naming the leader."""
        queue = self.host.get(queue_name)
        if not 0 <= shard < queue.config.shards:
            raise InvalidArgument("shard", f"queue {queue_name!r} has {queue.config.shards} shards")
        hosted = queue.by_index.get(shard)
        if hosted is None or not hosted.is_local_leader():
            raise queue.not_leader(shard)
        return hosted

    async def ExportMessages(
        self, request: export_pb2.ExportMessagesRequest, context: Context
    ) -> AsyncIterator[export_pb2.ExportedMessageBatch]:
        try:
            await self._admit(context, request.queue)
            shard = self._queue_and_shard(request.queue, request.shard)
            size = _batch_size(request.batch_size)
        except ShardqError as error:
            await abort_with(context, error)
            return
        await shard.committer.until_committed()  # the snapshot holds every answered send
        now_ms = wall_clock_ms()
        try:
            # Opened here, not in a worker: a cancellation cannot strand it unreleased.
            held = shard.environment.hold_read()
        except ShardqError as error:
            await abort_with(context, error)
            return
        try:
            snapshot_index = held.run(lambda tx: tx.last_index())
            # Every message in the snapshot must be stored on every in-sync replica: one
            # whose send is not yet replicated could be lost in a failover (and was never
            # acknowledged), and a report must not count it.
            if shard.replica is not None and not await shard.replica.wait_known_committed(snapshot_index):
                await abort_with(
                    context,
                    Unavailable(
                        f"shard {request.shard} of {request.queue!r}: its latest writes are not yet on every "
                        "in-sync replica; retry"
                    ),
                )
                return
            rows = held.tx.iter_messages()  # a generator: it touches the cursor only inside held.run

            def next_batch(_tx: object) -> list[export_pb2.ExportedMessage]:
                batch = []
                for record, delivery in rows:
                    batch.append(
                        exported_message(
                            request.shard, record, delivery, include_body=request.include_body, now_ms=now_ms
                        )
                    )
                    if len(batch) >= size:
                        break
                return batch

            while True:
                try:
                    batch = await asyncio.to_thread(held.run, next_batch)
                except ShardqError as error:
                    await abort_with(context, error)
                    return
                if not batch:
                    break
                yield export_pb2.ExportedMessageBatch(messages=batch, snapshot_log_index=snapshot_index)
        finally:
            # Never blocks: a batch still running in a worker closes the transaction itself.
            held.release()

    async def ReadJournal(
        self, request: export_pb2.ReadJournalRequest, context: Context
    ) -> AsyncIterator[export_pb2.JournalBatch]:
        try:
            await self._admit(context, request.queue)
            shard = self._queue_and_shard(request.queue, request.shard)
            size = _batch_size(request.batch_size)
        except ShardqError as error:
            await abort_with(context, error)
            return
        await shard.committer.until_committed()  # the journal holds every answered write

        def stored_bounds() -> tuple[int, int]:
            with shard.environment.read() as tx:
                return tx.first_log_index(), tx.last_index()

        def read_batch(start: int, end: int) -> tuple[list[export_pb2.JournalEvent], int]:
            # Its own short transaction, opened and closed in this worker thread:
            # a cancelled stream leaves nothing behind for another thread to free.
            events: list[export_pb2.JournalEvent] = []
            last = 0
            with shard.environment.read() as tx:
                for entry in tx.iter_log(from_index=start, to_index=end):
                    events.extend(journal_events(request.shard, entry))
                    last = entry.index
                    if len(events) >= size:
                        break
            return events, last

        try:
            first, written = await asyncio.to_thread(stored_bounds)
            readable = await readable_last_index(shard, written)
            start, end = max(request.from_index, first), min(request.to_index or readable + 1, readable + 1)
            while start < end:
                events, last = await asyncio.to_thread(read_batch, start, end)
                if not last:
                    break
                yield export_pb2.JournalBatch(events=events, next_index=last + 1)
                start = last + 1
        except ShardqError as error:
            await abort_with(context, error)

    async def GetJournalBounds(
        self, request: export_pb2.GetJournalBoundsRequest, context: Context
    ) -> export_pb2.JournalBounds:
        try:
            await self._admit(context, request.queue)
            shards = self.host.get(request.queue).config.shards
            hosted = self._queue_and_shard(request.queue, request.shard)
            await hosted.committer.until_committed()  # the bounds take in every answered write
            with hosted.environment.read() as tx:
                first, last = tx.first_log_index(), tx.last_index()
            return export_pb2.JournalBounds(
                first_index=first, last_index=await readable_last_index(hosted, last), shards=shards
            )
        except ShardqError as error:
            await abort_with(context, error)
            raise
