"""Error reasons shared by server and client, and the exceptions the client raises.

The reason strings travel on the wire (google.rpc.ErrorInfo.reason and
EntryError.reason), so their values never change once released.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    QUEUE_NOT_FOUND = "QUEUE_NOT_FOUND"
    QUEUE_FULL = "QUEUE_FULL"
    NOT_LEADER = "NOT_LEADER"
    STALE_RECEIPT = "STALE_RECEIPT"
    RECEIPT_EXPIRED = "RECEIPT_EXPIRED"
    MALFORMED_RECEIPT = "MALFORMED_RECEIPT"
    MESSAGE_NOT_FOUND = "MESSAGE_NOT_FOUND"
    WRONG_QUEUE = "WRONG_QUEUE"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # The write may or may not have been stored (e.g. leadership was lost before it
    # was replicated): retry only what is idempotent (dedup ids make sends so).
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    UNAVAILABLE = "UNAVAILABLE"
    # Runtime queue management.
    QUEUE_EXISTS = "QUEUE_EXISTS"
    QUEUE_IN_USE = "QUEUE_IN_USE"
    QUEUE_MANAGED_ELSEWHERE = "QUEUE_MANAGED_ELSEWHERE"
    # A local cluster's queue change found the cluster map locked by another process for
    # too long (one stopped in the middle of a change): nothing changed; try again.
    CLUSTER_MAP_LOCKED = "CLUSTER_MAP_LOCKED"
    # A call only the cluster's servers may make (replication, a call marked as forwarded)
    # came without the cluster's peer secret.
    NOT_A_PEER = "NOT_A_PEER"
    # A server that authenticates its clients (--client-auth kubernetes) got a call with
    # no token, or one the cluster does not accept (expired, for another audience).
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # The caller is known, and its rights do not include this verb on this queue.
    PERMISSION_DENIED = "PERMISSION_DENIED"


ERROR_DOMAIN = "shardq.io"


class ShardqError(Exception):
    """A request failed; `reason` says why in a machine-readable way."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        field: str = "",
        retry_after_ms: int = 0,
        leader: str = "",
    ) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.field = field
        self.retry_after_ms = retry_after_ms
        self.leader = leader


class InvalidArgument(ShardqError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(Reason.INVALID_ARGUMENT, f"{field}: {message}", field=field)


class QueueNotFound(ShardqError):
    def __init__(self, queue: str) -> None:
        super().__init__(Reason.QUEUE_NOT_FOUND, f"queue {queue!r} does not exist", field="queue")
        self.queue = queue


class QueueFull(ShardqError):
    def __init__(self, queue: str, retry_after_ms: int) -> None:
        super().__init__(
            Reason.QUEUE_FULL,
            f"queue {queue!r} is at its max depth; retry after {retry_after_ms} ms",
            retry_after_ms=retry_after_ms,
        )
        self.queue = queue


class NotLeader(ShardqError):
    def __init__(self, message: str, *, leader: str = "") -> None:
        super().__init__(Reason.NOT_LEADER, message, leader=leader)


class OutcomeUnknown(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.OUTCOME_UNKNOWN, message)


class Unavailable(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.UNAVAILABLE, message)


class QueueExists(ShardqError):
    def __init__(self, queue: str) -> None:
        super().__init__(Reason.QUEUE_EXISTS, f"queue {queue!r} already exists with other settings", field="queue")
        self.queue = queue


class QueueInUse(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.QUEUE_IN_USE, message, field="queue")


class NotAPeer(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.NOT_A_PEER, message)


class Unauthenticated(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.UNAUTHENTICATED, message)


class PermissionDenied(ShardqError):
    def __init__(self, message: str, *, queue: str = "") -> None:
        super().__init__(Reason.PERMISSION_DENIED, message, field="queue" if queue else "")
        self.queue = queue


class QueueManagedElsewhere(ShardqError):
    def __init__(self, message: str) -> None:
        super().__init__(Reason.QUEUE_MANAGED_ELSEWHERE, message, field="queue")
