"""Who may do what to which queue (pure): the verbs, the token a call carries, and the
bounded cache that keeps a server from asking the cluster about every call.

A server started with `--client-auth kubernetes` names each client call's verb and
queue, and lets it through only when the cluster says its caller may: Kubernetes
authenticates the bearer token (TokenReview) and authorises the verb on the queue
(SubjectAccessReview, apiGroup shardq.io, resource queues). Users grant rights with
ordinary Roles, the verbs below in `verbs` and the queue in `resourceNames`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Generic, TypeVar

from shardq.errors import Unauthenticated

# The API group and resource rights are asked for: the Queue resource's, so that a Role
# granting `send` on queues/orders reads as what it does.
ACCESS_GROUP = "shardq.io"
ACCESS_RESOURCE = "queues"

AUTHORIZATION_HEADER = "authorization"
BEARER = "bearer "
# A ServiceAccount token is 1-1.5 KiB; anything far longer is not one, and a review of it
# would only spend the API server's time. (gRPC itself refuses a call's metadata past
# 8 KiB some of the time, and past 16 KiB always.)
MAX_TOKEN_CHARS = 4 * 1024


class Verb(enum.StrEnum):
    """What a call does to a queue, as a Role's `verbs` names it."""

    SEND = "send"  # SendMessages, SendStream
    RECEIVE = "receive"  # ReceiveMessages (peeks too), DeleteMessages, ChangeVisibility, ReleaseMessages, ConsumeStream
    GET = "get"  # GetQueueAttributes (DescribeQueue also takes send or receive: clients route with it)
    LIST = "list"  # ListQueues: not for one queue, so only a rule without resourceNames grants it
    ADMIN = "admin"  # PurgeQueue, CreateQueue, DeleteQueue, SetQueueAttributes, Redrive (both queues)
    EXPORT = "export"  # ExportMessages, ReadJournal, GetJournalBounds: every message, without claiming it


# Whoever may send to or receive from a queue may learn its shards' leaders and settings:
# the client asks DescribeQueue before it routes.
DESCRIBE_VERBS = (Verb.GET, Verb.SEND, Verb.RECEIVE)


@dataclasses.dataclass(frozen=True)
class Identity:
    """A caller as the cluster's authenticator names it."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The token of the call's `authorization: Bearer …` entry; raises Unauthenticated
    naming what is missing or wrong (the token itself is never quoted)."""
    found = [value for key, value in metadata or () if key == AUTHORIZATION_HEADER]
    if not found:
        raise Unauthenticated(
            "this server authenticates its clients: send a ServiceAccount token as 'authorization: Bearer <token>' "
            "(shardq clients: --token-file or SHARDQ_TOKEN_FILE)"
        )
    if len(found) > 1:
        raise Unauthenticated("the call carries more than one authorization entry: send one")
    value = found[0]
    if not isinstance(value, str) or value[: len(BEARER)].lower() != BEARER:
        raise Unauthenticated("the authorization entry must read 'Bearer <token>'")
    token = value[len(BEARER) :].strip()
    if not token:
        raise Unauthenticated("the authorization entry carries an empty token")
    if len(token) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"the token is longer than {MAX_TOKEN_CHARS} characters: not a ServiceAccount token")
    return token


Key = TypeVar("Key")
Value = TypeVar("Value")


class ExpiringCache(Generic[Key, Value]):
    """At most `capacity` entries, each forgotten `ttl` seconds after it was put; when
    full, the oldest entry goes. Bounded so that a client sending a new token on every
    call costs reviews, not memory."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._entries: dict[Key, tuple[float, Value]] = {}

    def get(self, key: Key, now: float) -> Value | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if now >= expires:
            del self._entries[key]
            return None
        return value

    def put(self, key: Key, value: Value, *, now: float, ttl: float) -> None:
        self._entries.pop(key, None)
        while len(self._entries) >= self.capacity:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (now + ttl, value)

    def __len__(self) -> int:
        return len(self._entries)
