"""The gRPC side of the data source: ExportService calls with deadlines.

Only read-only RPCs live here (ExportMessages, ReadJournal, GetJournalBounds):
nothing in the read path claims, acknowledges or deletes a message, so a call
that failed for a passing reason (a server restarting, a leader being elected)
is simply made again.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import grpc

from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.bearer_tokens import bearer_token, with_token
from shardq.channel_options import RESOLVE_AGAIN_WITHIN_HALF_A_SECOND
from shardq.errors import Reason, ShardqError, Unavailable
from shardq.status import error_from_rpc
from shardq.tls import blocking_channel, client_tls

log = logging.getLogger(__name__)
T = TypeVar("T")

# Snapshot batches carry bodies; gRPC's 4 MiB default would refuse a batch of
# a few hundred large messages.
_MAX_RECEIVE_BYTES = 256 * 1024 * 1024
# NOT_LEADER answers followed in a row before waiting as for a passing failure (leadership
# moving meanwhile).
_LEADER_HOPS = 3
# How long a read keeps trying while servers restart or a shard has no leader: a rolling
# update restarts each pod in turn, and a leader is elected within a few seconds.
DEFAULT_RETRY_SECONDS = 60.0
_FIRST_BACKOFF_SECONDS = 0.1
_MAX_BACKOFF_SECONDS = 2.0
# Reasons that pass: the server is stopping or not reachable, or the shard has no leader yet.
_PASSING_REASONS = frozenset({Reason.UNAVAILABLE, Reason.SHUTTING_DOWN, Reason.NOT_LEADER})


def _passing(rpc_error: grpc.RpcError, error: ShardqError) -> bool:
    """Whether making the call again later may succeed. A deadline, a refused request or
    an unknown queue will not change; a connection refused or reset, a server shutting
    down or a shard between leaders will."""
    if error.reason is Reason.UNAVAILABLE:
        # A status without shardq's ErrorInfo is read as UNAVAILABLE whatever its code.
        return rpc_error.code() is grpc.StatusCode.UNAVAILABLE
    return error.reason in _PASSING_REASONS


class _Patience:
    """The retry budget of one read: backs off between attempts, says when it is spent,
    and counts the NOT_LEADER hints followed in a row."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadline = time.monotonic() + seconds
        self._backoff = _FIRST_BACKOFF_SECONDS
        self.leader_hops = 0

    @property
    def fresh(self) -> bool:
        """No attempt has been waited for since the budget was last (re)set."""
        return self._backoff == _FIRST_BACKOFF_SECONDS

    def wait(self) -> bool:
        """Sleep before the next attempt; False (without sleeping) once the budget is spent."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self._backoff, left))
        self._backoff = min(self._backoff * 2, _MAX_BACKOFF_SECONDS)
        return True

    def reset(self) -> None:
        """Progress was made: the next failure gets the whole budget again."""
        self._deadline = time.monotonic() + self.seconds
        self._backoff = _FIRST_BACKOFF_SECONDS


class ExportConnection:
    """Channels to a shardq server's ExportService. Not picklable: open it where it is
    used (on the driver for planning, in each task for reading).

    In a cluster a shard is exported by its leader (a follower's copy may lag, and a
    server holds only the shards placed on it): a server that does not lead a shard
    answers NOT_LEADER naming the leader, and the connection follows that hint, for
    that shard, from then on.

    A call that fails for a passing reason (see `_passing`) is made again, backing off,
    for up to `retry_seconds` (0: never), from the configured endpoint again: a leader
    that went away is found anew through its successor's NOT_LEADER hint. A journal
    stream that breaks resumes after the last batch it delivered; a snapshot
    (ExportMessages) that breaks after its first batch is not resumed, since a new
    snapshot would not be the same one: its error goes to the caller (Spark retries the
    task, which reads the shard's snapshot again from its start)."""

    def __init__(
        self, endpoint: str, *, rpc_timeout_seconds: float, retry_seconds: float = DEFAULT_RETRY_SECONDS
    ) -> None:
        self._rpc_timeout_seconds = rpc_timeout_seconds
        self._retry_seconds = retry_seconds
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, export_pb2_grpc.ExportServiceStub] = {}
        self._endpoint = endpoint
        self._leaders: dict[tuple[str, int], str] = {}
        # For servers that authenticate their clients: SHARDQ_TOKEN_FILE; for servers that
        # serve TLS: SHARDQ_CA_FILE or SHARDQ_TLS (set them on the executors too, e.g.
        # spark.executorEnv.SHARDQ_CA_FILE).
        self._token = bearer_token()
        self._tls = client_tls()

    def _stub(self, queue: str, shard: int) -> export_pb2_grpc.ExportServiceStub:
        endpoint = self._leaders.get((queue, shard), self._endpoint)
        stub = self._stubs.get(endpoint)
        if stub is None:
            channel = self._channels[endpoint] = blocking_channel(
                endpoint,
                self._tls,
                [("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES), RESOLVE_AGAIN_WITHIN_HALF_A_SECOND],
            )
            stub = self._stubs[endpoint] = with_token(export_pb2_grpc.ExportServiceStub(channel), self._token)
        return stub

    def _follow(self, error: ShardqError, queue: str, shard: int) -> bool:
        """Remember the leader a NOT_LEADER answer named; False when there is none to follow."""
        known = self._leaders.get((queue, shard), self._endpoint)
        if error.reason is not Reason.NOT_LEADER or not error.leader or error.leader == known:
            return False
        self._leaders[(queue, shard)] = error.leader
        return True

    def _recover(
        self, rpc_error: grpc.RpcError, queue: str, shard: int, what: str, patience: _Patience
    ) -> ShardqError | None:
        """None when the call should be made again (to a named leader, or after a wait);
        else the error to raise, which says how long the read kept trying."""
        error = error_from_rpc(rpc_error, queue=queue)
        if patience.leader_hops < _LEADER_HOPS and self._follow(error, queue, shard):
            patience.leader_hops += 1
            return None
        if not _passing(rpc_error, error) or patience.seconds <= 0:
            return error
        patience.leader_hops = 0
        # Back to the endpoint the reader was given: a leader that went away is found
        # again through the NOT_LEADER hint of whichever server answers.
        self._leaders.pop((queue, shard), None)
        if patience.fresh:  # once per outage, not once per attempt
            log.warning(
                "%s of queue %r shard %d failed (%s); trying again for up to %g s",
                what,
                queue,
                shard,
                error,
                patience.seconds,
            )
        if patience.wait():
            return None
        return Unavailable(
            f"{what} of queue {queue!r} shard {shard} still failing after {patience.seconds:g} s "
            f"of retries (option retrySeconds): {error.message}"
        )

    def _unary(self, call: Callable[[export_pb2_grpc.ExportServiceStub], T], queue: str, shard: int, what: str) -> T:
        patience = _Patience(self._retry_seconds)
        while True:
            try:
                return call(self._stub(queue, shard))
            except grpc.RpcError as rpc_error:
                error = self._recover(rpc_error, queue, shard, what, patience)
                if error is not None:
                    raise error from None

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
        request = export_pb2.GetJournalBoundsRequest(queue=queue, shard=shard)
        bounds: export_pb2.JournalBounds = self._unary(
            lambda stub: stub.GetJournalBounds(request, timeout=self._rpc_timeout_seconds),
            queue,
            shard,
            "GetJournalBounds",
        )
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
        resume_at = from_index

        def read_from_where_it_broke(stub: export_pb2_grpc.ExportServiceStub) -> Any:
            request = export_pb2.ReadJournalRequest(
                queue=queue, shard=shard, from_index=resume_at, to_index=to_index, batch_size=batch_size
            )
            return stub.ReadJournal(request)

        for batch in self._stream(read_from_where_it_broke, queue, shard, "ReadJournal", resumable=True):
            if batch.next_index:
                resume_at = batch.next_index
            yield batch

    def message_batches(
        self, *, queue: str, shard: int, include_body: bool, batch_size: int
    ) -> Generator[export_pb2.ExportedMessageBatch, None, None]:
        request = export_pb2.ExportMessagesRequest(
            queue=queue, shard=shard, include_body=include_body, batch_size=batch_size
        )
        yield from self._stream(lambda stub: stub.ExportMessages(request), queue, shard, "ExportMessages")

    def _stream(
        self,
        start: Callable[[export_pb2_grpc.ExportServiceStub], Any],
        queue: str,
        shard: int,
        what: str,
        *,
        resumable: bool = False,
    ) -> Generator[Any, None, None]:
        """The stream from the shard's leader: a NOT_LEADER answer is followed to the leader
        it names and a passing failure is retried, before the first item, or at any point
        when `start` resumes where the stream broke; other errors are the caller's."""
        patience = _Patience(self._retry_seconds)
        while True:
            call = start(self._stub(queue, shard))
            started = False
            try:
                for item in call:
                    if not started:
                        started = True
                        patience.reset()
                    yield item
                return
            except grpc.RpcError as rpc_error:
                if started and not resumable:
                    raise error_from_rpc(rpc_error, queue=queue) from None
                error = self._recover(rpc_error, queue, shard, what, patience)
                if error is not None:
                    raise error from None
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
