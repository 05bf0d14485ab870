"""Turning gRPC errors back into ShardqError with the server's reason and hints."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from shardq.api.v1 import queue_pb2
from shardq.errors import (
    ERROR_DOMAIN,
    InvalidArgument,
    NotLeader,
    OutcomeUnknown,
    PermissionDenied,
    QueueExists,
    QueueFull,
    QueueInUse,
    QueueManagedElsewhere,
    QueueNotFound,
    Reason,
    ShardqError,
    Unauthenticated,
    Unavailable,
)
from shardq.types import EntryResult


def _error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    trailing: tuple[tuple[str, str | bytes], ...] = ()
    # grpc.aio's AioRpcError is not a grpc.Call, yet carries trailing metadata too.
    if isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        trailing = tuple(error.trailing_metadata() or ())
    for key, value in trailing:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                    return info
    return None


def build_error(
    *, reason: str, message: str, field: str = "", retry_after_ms: int = 0, leader: str = "", queue: str = ""
) -> ShardqError:
    try:
        known = Reason(reason)
    except ValueError:
        known = Reason.UNAVAILABLE
    if known is Reason.INVALID_ARGUMENT:
        error: ShardqError = InvalidArgument(field, message.removeprefix(f"{field}: "))
    elif known is Reason.QUEUE_NOT_FOUND:
        error = QueueNotFound(queue)
    elif known is Reason.QUEUE_FULL:
        error = QueueFull(queue, retry_after_ms)
    elif known is Reason.NOT_LEADER:
        error = NotLeader(message, leader=leader)
    elif known is Reason.UNAVAILABLE:
        error = Unavailable(message)
    elif known is Reason.QUEUE_EXISTS:
        error = QueueExists(queue)
    elif known is Reason.QUEUE_IN_USE:
        error = QueueInUse(message)
    elif known is Reason.QUEUE_MANAGED_ELSEWHERE:
        error = QueueManagedElsewhere(message)
    elif known is Reason.OUTCOME_UNKNOWN:
        error = OutcomeUnknown(message)
    elif known is Reason.UNAUTHENTICATED:
        error = Unauthenticated(message)
    elif known is Reason.PERMISSION_DENIED:
        error = PermissionDenied(message, queue=queue)
    else:
        error = ShardqError(known, message, field=field, retry_after_ms=retry_after_ms, leader=leader)
    error.message = message
    return error


def answered_by_shardq(error: grpc.RpcError) -> bool:
    """Whether a shardq server gave this failure as its answer (it carries shardq's
    ErrorInfo), rather than the transport (a refused or cut connection, a deadline)."""
    return _error_info(error) is not None


def error_from_rpc(error: grpc.RpcError, *, queue: str = "") -> ShardqError:
    info = _error_info(error)
    details = error.details() if hasattr(error, "details") else str(error)
    message = details or ""
    if info is None:
        code = error.code() if hasattr(error, "code") else None
        return Unavailable(f"{code.name if code else 'error'}: {message}")
    metadata = dict(info.metadata)
    return build_error(
        reason=info.reason,
        message=message,
        field=metadata.get("field", ""),
        retry_after_ms=int(metadata.get("retry_after_ms", "0")),
        leader=metadata.get("leader", ""),
        queue=metadata.get("queue") or queue,
    )


def error_from_stream(error: queue_pb2.StreamError, *, queue: str = "") -> ShardqError:
    return build_error(
        reason=error.reason,
        message=error.message,
        field=error.field,
        retry_after_ms=error.retry_after_ms,
        queue=queue,
    )


def entry_results_from_proto(results: Iterable[queue_pb2.EntryResult]) -> list[EntryResult]:
    """Per-item outcomes (deletes, releases, visibility changes) as the client returns them."""
    return [EntryResult(r.ok, r.error.reason, r.error.message) for r in results]


# What gRPC says when a host name does not resolve: the older resolvers' words and those
# of the current one (grpcio 1.85: "errors resolving garbage: ... Domain name not found").
UNRESOLVED_HOST_TEXTS = (
    "errors resolving",
    "Domain name not found",
    "DNS resolution failed",
    "Name or service not known",
    "nodename nor servname provided",
    "Temporary failure in name resolution",
)


def host_unresolved(error: grpc.RpcError) -> bool:
    """Whether a call failed because its host name did not resolve."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and any(words in details for words in UNRESOLVED_HOST_TEXTS)


def never_sent(error: grpc.RpcError) -> bool:
    """Whether a call failed before reaching any server (so it changed nothing): refused,
    not connected, or its host name did not resolve (a leader's in-cluster name, seen
    from outside the cluster's network, which said OUTCOME_UNKNOWN for a call never sent)."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = error.details() or ""
    return "failed to connect" in details or "Connection refused" in details or host_unresolved(error)


def unknown_if_sent(error: grpc.RpcError, failure: ShardqError, what: str) -> ShardqError:
    """`failure` (from `error`), or OutcomeUnknown when the connection failed with `what`
    already sent: the server may have applied it, and UNAVAILABLE would say it did not."""
    if isinstance(failure, Unavailable) and not never_sent(error):
        return OutcomeUnknown(f"{what}, which may or may not have been applied ({failure.message})")
    return failure
