"""Letting a client call through, or refusing it: the token reviewed, the verb on the
queue authorised, both remembered for a while (shard_server.domain.client_access).

Reviews are blocking requests to the cluster (kubernetes_reviews.py); they run on worker
threads, at most a few at once, and callers asking the same question at the same moment
share one review. What the cluster answered is remembered: an accepted token and a
granted verb for a minute, a refusal for ten seconds. So a client's calls cost one
review each minute, not one per call, and a right taken away stops working within a
minute (as Kubernetes' own webhook authorisers cache theirs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol, TypeVar

from shard_server import metrics
from shard_server.domain.client_access import ExpiringCache, Identity, Verb, bearer_token
from shardq.errors import PermissionDenied, ShardqError, Unauthenticated

IDENTITY_TTL_S = 60.0
DECISION_TTL_S = 60.0
# A refused token or right is asked about again sooner: it may just have been granted.
REFUSAL_TTL_S = 10.0
MAX_TOKENS_REMEMBERED = 4096
MAX_DECISIONS_REMEMBERED = 16384
# Reviews in flight at once, on threads of their own: a client sending a new token each
# call makes reviews at the pace the cluster answers them, not as many as it likes, and
# an API server that hangs holds these threads, not the ones that read the shards.
MAX_REVIEWS_IN_FLIGHT = 8

Metadata = Iterable[tuple[str, str | bytes]] | None
T = TypeVar("T")


class Reviews(Protocol):
    """The cluster's answers (blocking). `identity` raises Unauthenticated for a token it
    does not accept and Unavailable when it cannot say."""

    def identity(self, token: str) -> Identity: ...

    def allows(self, identity: Identity, verb: Verb, queue: str) -> bool: ...


class ClientAccess(Protocol):
    # False: every caller may do anything, and servicers skip the check altogether.
    enforced: bool

    async def require(self, metadata: Metadata, verbs: tuple[Verb, ...], queue: str) -> None:
        """Returns when the call's caller may do one of `verbs` to `queue` ("" for calls
        about no one queue); raises Unauthenticated or PermissionDenied otherwise."""
        ...


class OpenAccess:
    """No client authentication (`--client-auth none`)."""

    enforced = False

    async def require(self, metadata: Metadata, verbs: tuple[Verb, ...], queue: str) -> None:
        return None


OPEN_ACCESS = OpenAccess()


class ReviewedAccess:
    """Every call's token reviewed and its verb authorised by `reviews`, remembered."""

    enforced = True

    def __init__(self, reviews: Reviews, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.reviews = reviews
        self.clock = clock
        self._identities: ExpiringCache[bytes, Identity | Unauthenticated] = ExpiringCache(MAX_TOKENS_REMEMBERED)
        self._decisions: ExpiringCache[tuple[Identity, Verb, str], bool] = ExpiringCache(MAX_DECISIONS_REMEMBERED)
        self._asking: dict[Hashable, asyncio.Future[Any]] = {}
        self._reviewers = concurrent.futures.ThreadPoolExecutor(MAX_REVIEWS_IN_FLIGHT, "client-reviews")

    async def require(self, metadata: Metadata, verbs: tuple[Verb, ...], queue: str) -> None:
        identity = await self._identity(bearer_token(metadata))
        for verb in verbs:
            if await self._allows(identity, verb, queue):
                return
        named = f" named {queue!r}" if queue else ""
        if len(verbs) == 1:
            grant = f"a Role allowing verb {verbs[0].value!r} on shardq.io queues{named}"
        else:
            grant = (
                f"a Role allowing one of the verbs {', '.join(verb.value for verb in verbs)} on shardq.io queues{named}"
            )
        raise PermissionDenied(
            f"{identity.username} may not {' or '.join(verb.value for verb in verbs)} "
            f"{f'on queue {queue!r}' if queue else 'queues'}: grant it {grant}",
            queue=queue,
        )

    async def _identity(self, token: str) -> Identity:
        key = hashlib.sha256(token.encode()).digest()
        known = self._identities.get(key, self.clock())
        if known is None:
            try:
                known = await self._once(key, lambda: _counted("token", lambda: self.reviews.identity(token)))
            except Unauthenticated as refused:
                known = refused
            ttl = REFUSAL_TTL_S if isinstance(known, Unauthenticated) else IDENTITY_TTL_S
            self._identities.put(key, known, now=self.clock(), ttl=ttl)
        if isinstance(known, Unauthenticated):
            raise Unauthenticated(known.message)
        return known

    async def _allows(self, identity: Identity, verb: Verb, queue: str) -> bool:
        key = (identity, verb, queue)
        known = self._decisions.get(key, self.clock())
        if known is None:
            known = await self._once(
                key, lambda: _counted("access", lambda: self.reviews.allows(identity, verb, queue))
            )
            self._decisions.put(key, known, now=self.clock(), ttl=DECISION_TTL_S if known else REFUSAL_TTL_S)
        return known

    async def _once(self, key: Hashable, ask: Callable[[], T]) -> T:
        """`ask` on a reviewer thread; callers asking about the same key meanwhile share
        its answer. A caller cancelled while waiting leaves the review to the others."""
        shared: asyncio.Future[Any] | None = self._asking.get(key)
        if shared is None:
            shared = asyncio.get_running_loop().run_in_executor(self._reviewers, ask)
            self._asking[key] = shared
            shared.add_done_callback(lambda done: self._settled(key, done))
        answer: T = await asyncio.shield(shared)  # the same key always asks the same question
        return answer

    def _settled(self, key: Hashable, done: asyncio.Future[Any]) -> None:
        self._asking.pop(key, None)
        if not done.cancelled():
            done.exception()  # read: a review every asker stopped waiting for is not "never retrieved"


def _counted(review: str, ask: Callable[[], T]) -> T:
    """`ask`, counted in shardq_client_reviews_total by how the API server answered."""
    try:
        answer = ask()
    except Unauthenticated:
        metrics.CLIENT_REVIEWS.labels(review, "refused").inc()
        raise
    except ShardqError:
        metrics.CLIENT_REVIEWS.labels(review, "unanswered").inc()
        raise
    metrics.CLIENT_REVIEWS.labels(review, "refused" if answer is False else "accepted").inc()
    return answer
