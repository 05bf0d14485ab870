"""The one table from error reasons to gRPC status codes, and how errors are sent.

Whole-call errors carry a google.rpc.ErrorInfo (reason, domain, and metadata
naming the field, a retry delay or a leader hint) in grpc-status-details-bin,
so any gRPC client can read them; the shardq client turns them back into
ShardqError subclasses.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from shardq.api.v1 import queue_pb2
from shardq.errors import ERROR_DOMAIN, Reason, ShardqError

STATUS_BY_REASON: dict[Reason, grpc.StatusCode] = {
    Reason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.MALFORMED_RECEIPT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.QUEUE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.MESSAGE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.NOT_LEADER: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STALE_RECEIPT: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.RECEIPT_EXPIRED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.WRONG_QUEUE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Reason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.OUTCOME_UNKNOWN: grpc.StatusCode.UNAVAILABLE,
    Reason.QUEUE_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Reason.QUEUE_IN_USE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.QUEUE_MANAGED_ELSEWHERE: grpc.StatusCode.FAILED_PRECONDITION,
    # Not UNAVAILABLE: a client takes that, answered to a call that is not idempotent
    # (DeleteQueue), for "may have been applied", as a forwarding server relays a cut call.
    Reason.CLUSTER_MAP_LOCKED: grpc.StatusCode.ABORTED,
    Reason.NOT_A_PEER: grpc.StatusCode.UNAUTHENTICATED,
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}


def error_metadata(error: ShardqError) -> dict[str, str]:
    metadata: dict[str, str] = {}
    if error.field:
        metadata["field"] = error.field
    if error.retry_after_ms:
        metadata["retry_after_ms"] = str(error.retry_after_ms)
    if error.leader:
        metadata["leader"] = error.leader
    queue = getattr(error, "queue", "")
    if queue:
        # The client names the queue from here, not from what it asked about
        # (a redrive asks about two).
        metadata["queue"] = queue
    return metadata


def status_details(error: ShardqError) -> bytes:
    code = STATUS_BY_REASON[error.reason]
    info = error_details_pb2.ErrorInfo(reason=error.reason.value, domain=ERROR_DOMAIN, metadata=error_metadata(error))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=error.message, details=[detail])
    return bytes(status.SerializeToString())


async def abort_with(context: grpc.aio.ServicerContext[object, object], error: ShardqError) -> None:
    code = STATUS_BY_REASON[error.reason]
    await context.abort(code, error.message, trailing_metadata=(("grpc-status-details-bin", status_details(error)),))


def stream_error(error: ShardqError) -> queue_pb2.StreamError:
    return queue_pb2.StreamError(
        code=STATUS_BY_REASON[error.reason].name,
        reason=error.reason.value,
        message=error.message,
        field=error.field,
        retry_after_ms=error.retry_after_ms,
    )


def entry_error(reason: Reason) -> queue_pb2.EntryError:
    return queue_pb2.EntryError(reason=reason.value, message=ENTRY_ERROR_TEXT.get(reason, reason.value))


ENTRY_ERROR_TEXT = {
    Reason.STALE_RECEIPT: "the message was received again since this receipt was issued",
    Reason.RECEIPT_EXPIRED: "the visibility timeout of this receipt has passed",
    Reason.MALFORMED_RECEIPT: "not a receipt issued by shardq",
    Reason.MESSAGE_NOT_FOUND: "the message is no longer stored (deleted, expired or dead-lettered)",
    Reason.WRONG_QUEUE: "the receipt belongs to another queue",
}
