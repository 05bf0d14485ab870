"""How a server that authenticates its clients asks the cluster: each question once while
its answer is remembered, concurrent askers sharing one review, refusals remembered for
less time than grants, and memory bounded whatever tokens clients send.

The reviewer here is a stand-in that counts questions (the real one, TokenReview and
SubjectAccessReview against a real kube-apiserver, is tested in
e2e/test_clients_need_a_token_and_a_right_to_each_queue.py); what is tested is the
remembering and sharing around it, which no API server could make deterministic.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from shard_server import metrics
from shard_server.domain.client_access import (
    MAX_TOKEN_CHARS,
    ExpiringCache,
    Identity,
    Verb,
    bearer_token,
)
from shard_server.runtime.client_access import (
    DECISION_TTL_S,
    IDENTITY_TTL_S,
    MAX_TOKENS_REMEMBERED,
    REFUSAL_TTL_S,
    ReviewedAccess,
)
from shardq.errors import PermissionDenied, Unauthenticated, Unavailable

ALICE = Identity("system:serviceaccount:apps:alice", uid="u-1", groups=("system:serviceaccounts",))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingReviews:
    """Accepts the tokens in `tokens`; grants what `rights` lists. Counts every question."""

    def __init__(self) -> None:
        self.tokens = {"alice-token": ALICE}
        self.rights = {(ALICE, Verb.SEND, "orders")}
        self.token_reviews = 0
        self.access_reviews = 0
        self.release: threading.Event | None = None
        self.unavailable = False

    def identity(self, token: str) -> Identity:
        self.token_reviews += 1
        if self.release is not None:
            self.release.wait(5)
        if self.unavailable:
            raise Unavailable("cannot check the caller's token now: the API server did not answer")
        if token not in self.tokens:
            raise Unauthenticated("the cluster does not accept this token")
        return self.tokens[token]

    def allows(self, identity: Identity, verb: Verb, queue: str) -> bool:
        self.access_reviews += 1
        return (identity, verb, queue) in self.rights


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def reviews_counted(review: str, outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value("shardq_client_reviews_total", {"review": review, "outcome": outcome})
    return value or 0.0


def test_a_token_and_a_right_are_reviewed_once_while_remembered_then_again() -> None:
    before = {
        (review, outcome): reviews_counted(review, outcome)
        for review in ("token", "access")
        for outcome in ("accepted", "refused")
    }

    async def scenario() -> None:
        clock, reviews = Clock(), CountingReviews()
        access = ReviewedAccess(reviews, clock=clock)
        for _ in range(50):
            await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        assert (reviews.token_reviews, reviews.access_reviews) == (1, 1)
        clock.now += min(IDENTITY_TTL_S, DECISION_TTL_S) - 0.1
        await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        assert (reviews.token_reviews, reviews.access_reviews) == (1, 1)
        clock.now += 0.2  # past both
        await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        assert (reviews.token_reviews, reviews.access_reviews) == (2, 2)

    asyncio.run(scenario())
    after = {key: reviews_counted(*key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("token", "accepted"): 2,
        ("access", "accepted"): 2,
        ("token", "refused"): 0,
        ("access", "refused"): 0,
    }


def test_a_right_taken_away_stops_working_once_its_grant_is_forgotten() -> None:
    async def scenario() -> None:
        clock, reviews = Clock(), CountingReviews()
        access = ReviewedAccess(reviews, clock=clock)
        await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        reviews.rights.clear()
        await access.require(bearer("alice-token"), (Verb.SEND,), "orders")  # still remembered
        clock.now += DECISION_TTL_S
        with pytest.raises(PermissionDenied) as denied:
            await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        assert denied.value.queue == "orders"
        assert "alice may not send on queue 'orders'" in denied.value.message
        assert "verb 'send' on shardq.io queues named 'orders'" in denied.value.message

    asyncio.run(scenario())


def test_refusals_are_remembered_for_less_time_than_grants() -> None:
    async def scenario() -> None:
        clock, reviews = Clock(), CountingReviews()
        access = ReviewedAccess(reviews, clock=clock)
        for _ in range(3):
            with pytest.raises(Unauthenticated):
                await access.require(bearer("stolen"), (Verb.SEND,), "orders")
            with pytest.raises(PermissionDenied):
                await access.require(bearer("alice-token"), (Verb.RECEIVE,), "orders")
        assert (reviews.token_reviews, reviews.access_reviews) == (2, 1)
        # Granted meanwhile: taken once the refusal is forgotten, well before a grant would be.
        reviews.tokens["stolen"] = ALICE
        reviews.rights.add((ALICE, Verb.RECEIVE, "orders"))
        clock.now += REFUSAL_TTL_S
        assert min(IDENTITY_TTL_S, DECISION_TTL_S) > REFUSAL_TTL_S
        await access.require(bearer("stolen"), (Verb.SEND,), "orders")
        await access.require(bearer("alice-token"), (Verb.RECEIVE,), "orders")

    asyncio.run(scenario())


def test_any_of_several_verbs_admits_and_the_refusal_names_them_all() -> None:
    async def scenario() -> None:
        reviews = CountingReviews()
        access = ReviewedAccess(reviews, clock=Clock())
        await access.require(bearer("alice-token"), (Verb.GET, Verb.SEND, Verb.RECEIVE), "orders")
        with pytest.raises(PermissionDenied) as denied:
            await access.require(bearer("alice-token"), (Verb.GET, Verb.SEND, Verb.RECEIVE), "audit")
        assert "may not get or send or receive on queue 'audit'" in denied.value.message
        assert "one of the verbs get, send, receive" in denied.value.message
        with pytest.raises(PermissionDenied) as denied:
            await access.require(bearer("alice-token"), (Verb.LIST,), "")
        assert "may not list queues:" in denied.value.message
        assert denied.value.queue == ""

    asyncio.run(scenario())


def test_callers_asking_the_same_question_at_once_share_one_review() -> None:
    async def scenario() -> None:
        reviews = CountingReviews()
        reviews.release = threading.Event()
        access = ReviewedAccess(reviews, clock=Clock())
        calls = [asyncio.create_task(access.require(bearer("alice-token"), (Verb.SEND,), "orders")) for _ in range(20)]
        await asyncio.sleep(0.05)
        reviews.release.set()
        await asyncio.gather(*calls)
        assert (reviews.token_reviews, reviews.access_reviews) == (1, 1)

    asyncio.run(scenario())


def test_a_caller_that_gives_up_leaves_the_review_to_the_others() -> None:
    async def scenario() -> None:
        reviews = CountingReviews()
        reviews.release = threading.Event()
        access = ReviewedAccess(reviews, clock=Clock())
        quitter = asyncio.create_task(access.require(bearer("alice-token"), (Verb.SEND,), "orders"))
        stayer = asyncio.create_task(access.require(bearer("alice-token"), (Verb.SEND,), "orders"))
        await asyncio.sleep(0.05)
        quitter.cancel()
        reviews.release.set()
        await stayer  # admitted: the shared review was not cancelled with the quitter
        assert quitter.cancelled()
        assert reviews.token_reviews == 1

    asyncio.run(scenario())


def test_an_api_server_that_cannot_answer_admits_nobody_and_is_asked_again_next_call() -> None:
    async def scenario() -> None:
        reviews = CountingReviews()
        reviews.unavailable = True
        access = ReviewedAccess(reviews, clock=Clock())
        for _ in range(2):
            with pytest.raises(Unavailable):
                await access.require(bearer("alice-token"), (Verb.SEND,), "orders")
        assert reviews.token_reviews == 2  # not remembered: no answer is no refusal
        reviews.unavailable = False
        await access.require(bearer("alice-token"), (Verb.SEND,), "orders")

    asyncio.run(scenario())


def test_a_client_sending_a_new_token_each_call_costs_reviews_not_memory() -> None:
    async def scenario() -> ReviewedAccess:
        access = ReviewedAccess(CountingReviews(), clock=Clock())
        for index in range(MAX_TOKENS_REMEMBERED + 50):
            with pytest.raises(Unauthenticated):
                await access.require(bearer(f"garbage-{index}"), (Verb.SEND,), "orders")
        return access

    access = asyncio.run(scenario())
    assert len(access._identities) == MAX_TOKENS_REMEMBERED


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ((), "send a ServiceAccount token as 'authorization: Bearer <token>'"),
        ((("authorization", "Basic abc"),), "must read 'Bearer <token>'"),
        ((("authorization", b"Bearer abc"),), "must read 'Bearer <token>'"),
        ((("authorization", "Bearer   "),), "empty token"),
        ((("authorization", "Bearer a"), ("authorization", "Bearer b")), "more than one authorization entry"),
        ((("authorization", "Bearer " + "x" * (MAX_TOKEN_CHARS + 1)),), "not a ServiceAccount token"),
    ],
)
def test_a_call_without_one_bearer_token_is_refused_naming_what_is_wrong(
    metadata: tuple[tuple[str, str | bytes], ...], words: str
) -> None:
    with pytest.raises(Unauthenticated, match=words):
        bearer_token(metadata)


def test_the_bearer_scheme_is_read_in_any_case_and_the_token_trimmed() -> None:
    assert bearer_token((("authorization", "bearer  abc.def "),)) == "abc.def"
    assert bearer_token((("x-other", "1"), ("authorization", "BEARER abc"))) == "abc"


def test_the_cache_forgets_at_its_deadline_and_drops_the_oldest_when_full() -> None:
    cache: ExpiringCache[str, int] = ExpiringCache(2)
    cache.put("a", 1, now=0.0, ttl=10.0)
    cache.put("b", 2, now=1.0, ttl=10.0)
    assert cache.get("a", 9.9) == 1
    assert cache.get("a", 10.0) is None
    cache.put("a", 1, now=10.0, ttl=10.0)
    cache.put("c", 3, now=10.0, ttl=10.0)  # full: b, the oldest, goes
    assert (cache.get("b", 10.0), cache.get("a", 10.0), cache.get("c", 10.0)) == (None, 1, 3)
    with pytest.raises(ValueError, match="capacity"):
        ExpiringCache[str, int](0)
