"""shardq: a durable, SQS-class message queue for Kubernetes — the client SDK.

`Client` (blocking) and `AsyncClient` (asyncio) speak to any shard server over
gRPC. This package depends on nothing else of ours: the server and operator
import it, never the other way round.

The top-level names are loaded on first use (PEP 562): `import shardq.queues`
or `shardq.errors` (as the server's pure domain does) must not load gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardq.aio import AsyncClient
    from shardq.client import Client
    from shardq.consumer import ConsumerStats, DeadLetter, run_consumer
    from shardq.consumer_streams import ConsumerStream
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

# Each public name and the module that defines it.
_HOMES = {
    "AsyncClient": "shardq.aio",
    "ConsumerStream": "shardq.consumer_streams",
    "Client": "shardq.client",
    "ConsumerStats": "shardq.consumer",
    "DeadLetter": "shardq.consumer",
    "run_consumer": "shardq.consumer",
    "InvalidArgument": "shardq.errors",
    "NotLeader": "shardq.errors",
    "OutcomeUnknown": "shardq.errors",
    "QueueFull": "shardq.errors",
    "QueueNotFound": "shardq.errors",
    "Reason": "shardq.errors",
    "ShardqError": "shardq.errors",
    "Unavailable": "shardq.errors",
    "EntryResult": "shardq.types",
    "Message": "shardq.types",
    "QueueAttributes": "shardq.types",
    "ReceivedMessage": "shardq.types",
    "RedriveProgress": "shardq.types",
    "SendResult": "shardq.types",
    "ShardAttributes": "shardq.types",
    "ShardRoute": "shardq.types",
}

__all__ = [
    "AsyncClient",
    "Client",
    "ConsumerStats",
    "ConsumerStream",
    "DeadLetter",
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
assert sorted(__all__) == sorted(_HOMES), "every public name has a home"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'shardq' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
