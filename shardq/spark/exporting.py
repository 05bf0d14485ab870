"""The gRPC side of the data source: ExportService calls with deadlines.

Only read-only RPCs live here (ExportMessages, ReadJournal, GetJournalBounds):
nothing in the read path claims, acknowledges or deletes a message.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Generator
from typing import Any

import grpc

from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.errors import Reason, ShardqError
from shardq.status import error_from_rpc

# Snapshot batches carry bodies; gRPC's 4 MiB default would refuse a batch of
# a few hundred large messages.
_MAX_RECEIVE_BYTES = 256 * 1024 * 1024
# NOT_LEADER answers followed for one call before giving up (leadership moving meanwhile).
_LEADER_HOPS = 3


class ExportConnection:
    """Channels to a shardq server's ExportService. Not picklable: open it where it is
    used (on the driver for planning, in each task for reading).

    In a cluster a shard is exported by its leader (a follower's copy may lag, and a
    server holds only the shards placed on it): a server that does not lead a shard
    answers NOT_LEADER naming the leader, and the connection follows that hint, for
    that shard, from then on."""

    def __init__(self, endpoint: str, *, rpc_timeout_seconds: float) -> None:
        self._rpc_timeout_seconds = rpc_timeout_seconds
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, export_pb2_grpc.ExportServiceStub] = {}
        self._endpoint = endpoint
        self._leaders: dict[tuple[str, int], str] = {}

    def _stub(self, queue: str, shard: int) -> export_pb2_grpc.ExportServiceStub:
        endpoint = self._leaders.get((queue, shard), self._endpoint)
        stub = self._stubs.get(endpoint)
        if stub is None:
            channel = self._channels[endpoint] = grpc.insecure_channel(
                endpoint,
                options=[
                    ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
                    # A leader's pod restarted mid-report is at a new address: look its
                    # name up again within a second, not gRPC's default 30 s.
                    ("grpc.dns_min_time_between_resolutions_ms", 500),
                ],
            )
            stub = self._stubs[endpoint] = export_pb2_grpc.ExportServiceStub(channel)
        return stub

    def _follow(self, error: ShardqError, queue: str, shard: int) -> bool:
        """Remember the leader a NOT_LEADER answer named; False when there is none to follow."""
        known = self._leaders.get((queue, shard), self._endpoint)
        if error.reason is not Reason.NOT_LEADER or not error.leader or error.leader == known:
            return False
        self._leaders[(queue, shard)] = error.leader
        return True

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
        for channel in self._channels.values():
            channel.close()

    def journal_bounds(self, queue: str, shard: int) -> export_pb2.JournalBounds:
        """Raises ShardqError (QueueNotFound, Unavailable...) naming what went wrong."""
        for _ in range(_LEADER_HOPS):
            try:
                bounds: export_pb2.JournalBounds = self._stub(queue, shard).GetJournalBounds(
                    export_pb2.GetJournalBoundsRequest(queue=queue, shard=shard),
                    timeout=self._rpc_timeout_seconds,
                )
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, queue=queue)
                if self._follow(error, queue, shard):
                    continue
                raise error from None
            return bounds
        raise error

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
        yield from self._stream(lambda stub: stub.ReadJournal(request), queue, shard)

    def message_batches(
        self, *, queue: str, shard: int, include_body: bool, batch_size: int
    ) -> Generator[export_pb2.ExportedMessageBatch, None, None]:
        request = export_pb2.ExportMessagesRequest(
            queue=queue, shard=shard, include_body=include_body, batch_size=batch_size
        )
        yield from self._stream(lambda stub: stub.ExportMessages(request), queue, shard)

    def _stream(
        self, start: Callable[[export_pb2_grpc.ExportServiceStub], Any], queue: str, shard: int
    ) -> Generator[Any, None, None]:
        """The stream from the shard's leader: a NOT_LEADER answer before the first item
        is followed to the leader it names; an error after that is the caller's."""
        for _ in range(_LEADER_HOPS):
            call = start(self._stub(queue, shard))
            started = False
            try:
                for item in call:
                    started = True
                    yield item
                return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, queue=queue)
                if started or not self._follow(error, queue, shard):
                    raise
            finally:
                # A consumer that stops early (counting for a read limit) must not
                # leave the server streaming into a full window.
                call.cancel()


def journal_end_index(bounds: export_pb2.JournalBounds) -> int:
    """The exclusive end of what a shard holds now: where a reader stops."""
    return bounds.last_index + 1


def journal_start_index(bounds: export_pb2.JournalBounds) -> int:
    # An empty log reports first_index 0; reading starts at the first index ever written.
    return max(bounds.first_index, 1)
