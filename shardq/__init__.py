"""shardq: a durable, SQS-class message queue for Kubernetes — the client SDK.

`Client` (blocking) and `AsyncClient` (asyncio) speak to any shard server over
gRPC. This package depends on nothing else of ours: the server and operator
import it, never the other way round.
"""

from shardq.aio import AsyncClient, ConsumerStream
from shardq.client import Client
from shardq.consumer import ConsumerStats, run_consumer
from shardq.errors import (
    InvalidArgument,
    NotLeader,
    OutcomeUnknown,
    QueueFull,
    QueueNotFound,
    Reason,
    ShardqError,
    Unavailable,
)
from shardq.types import (
    EntryResult,
    Message,
    QueueAttributes,
    ReceivedMessage,
    RedriveProgress,
    SendResult,
    ShardAttributes,
    ShardRoute,
)

__all__ = [
    "AsyncClient",
    "Client",
    "ConsumerStats",
    "ConsumerStream",
    "EntryResult",
    "InvalidArgument",
    "Message",
    "NotLeader",
    "OutcomeUnknown",
    "QueueAttributes",
    "QueueFull",
    "QueueNotFound",
    "Reason",
    "ReceivedMessage",
    "RedriveProgress",
    "SendResult",
    "ShardAttributes",
    "ShardRoute",
    "ShardqError",
    "Unavailable",
    "run_consumer",
]
