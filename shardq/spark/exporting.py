"""The gRPC side of the data source: ExportService calls with deadlines.

Only read-only RPCs live here (ExportMessages, ReadJournal, GetJournalBounds):
nothing in the read path claims, acknowledges or deletes a message.
"""

from __future__ import annotations

import types
from collections.abc import Generator

import grpc

from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.status import error_from_rpc

# Snapshot batches carry bodies; gRPC's 4 MiB default would refuse a batch of
# a few hundred large messages.
_MAX_RECEIVE_BYTES = 256 * 1024 * 1024


class ExportConnection:
    """One channel to a shardq server's ExportService. Not picklable: open it
    where it is used (on the driver for planning, in each task for reading)."""

    def __init__(self, endpoint: str, *, rpc_timeout_seconds: float) -> None:
        self._channel = grpc.insecure_channel(
            endpoint, options=[("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES)]
        )
        self._stub = export_pb2_grpc.ExportServiceStub(self._channel)
        self._rpc_timeout_seconds = rpc_timeout_seconds

    def __enter__(self) -> ExportConnection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def journal_bounds(self, queue: str, shard: int) -> export_pb2.JournalBounds:
        """Raises ShardqError (QueueNotFound, Unavailable...) naming what went wrong."""
        try:
            bounds: export_pb2.JournalBounds = self._stub.GetJournalBounds(
                export_pb2.GetJournalBoundsRequest(queue=queue, shard=shard),
                timeout=self._rpc_timeout_seconds,
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error, queue=queue) from None
        return bounds

    def all_journal_bounds(self, queue: str) -> dict[int, export_pb2.JournalBounds]:
        """Bounds of every shard; shard 0 tells how many shards there are."""
        first = self.journal_bounds(queue, 0)
        bounds = {0: first}
        for shard in range(1, first.shards):
            bounds[shard] = self.journal_bounds(queue, shard)
        return bounds

    def shard_count(self, queue: str) -> int:
        return self.journal_bounds(queue, 0).shards

    def journal_batches(
        self, *, queue: str, shard: int, from_index: int, to_index: int, batch_size: int
    ) -> Generator[export_pb2.JournalBatch, None, None]:
        """Events of log indexes [from_index, to_index); the stream ends at to_index.

        Streams carry no deadline: reading a long journal may take a while, and
        a dropped connection ends the stream with an error anyway.
        """
        request = export_pb2.ReadJournalRequest(
            queue=queue, shard=shard, from_index=from_index, to_index=to_index, batch_size=batch_size
        )
        call = self._stub.ReadJournal(request)
        try:
            yield from call
        finally:
            # A consumer that stops early (counting for a read limit) must not
            # leave the server streaming into a full window.
            call.cancel()

    def message_batches(
        self, *, queue: str, shard: int, include_body: bool, batch_size: int
    ) -> Generator[export_pb2.ExportedMessageBatch, None, None]:
        request = export_pb2.ExportMessagesRequest(
            queue=queue, shard=shard, include_body=include_body, batch_size=batch_size
        )
        call = self._stub.ExportMessages(request)
        try:
            yield from call
        finally:
            call.cancel()


def journal_end_index(bounds: export_pb2.JournalBounds) -> int:
    """The exclusive end of what a shard holds now: where a reader stops."""
    return bounds.last_index + 1


def journal_start_index(bounds: export_pb2.JournalBounds) -> int:
    # An empty log reports first_index 0; reading starts at the first index ever written.
    return max(bounds.first_index, 1)
