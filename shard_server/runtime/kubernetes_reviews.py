"""The cluster's word on a client: TokenReview for who holds a token, SubjectAccessReview
for whether they may do a verb to a queue (blocking requests; client_access.py runs
them on worker threads and remembers the answers).

The server asks as its own ServiceAccount, which needs `create` on tokenreviews and
subjectaccessreviews (the built-in ClusterRole system:auth-delegator; the operator binds
it when a ShardqCluster authenticates its clients).
"""

from __future__ import annotations

import pathlib

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from shard_server.domain.client_access import ACCESS_GROUP, ACCESS_RESOURCE, Identity, Verb
from shardq.coordination.kubernetes_leases import connect
from shardq.errors import Unauthenticated, Unavailable

# A review outliving this is no answer: the call it holds up would rather fail and be retried.
REVIEW_TIMEOUT_S = 5.0
_FORBIDDEN = 403
NEEDED_RIGHTS = (
    "this server's ServiceAccount needs create on tokenreviews and subjectaccessreviews: "
    "bind it to the ClusterRole system:auth-delegator"
)


class KubernetesReviews:
    def __init__(self, api: client.ApiClient, *, namespace: str, audience: str) -> None:
        self.namespace = namespace
        self.audience = audience
        self._authentication = client.AuthenticationV1Api(api)
        self._authorization = client.AuthorizationV1Api(api)

    def identity(self, token: str) -> Identity:
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[self.audience]))
        try:
            answer = self._authentication.create_token_review(review, _request_timeout=REVIEW_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
            raise Unavailable(f"cannot check the caller's token now: {_failure(error)}") from None
        status = answer.status
        if status is None or not status.authenticated or status.user is None:
            why = f" ({status.error})" if status is not None and status.error else ""
            raise Unauthenticated(
                f"the cluster does not accept this token for audience {self.audience!r}{why}: "
                "send a current ServiceAccount token issued for that audience"
            )
        # The API server answers only for an audience the token was issued for; checked
        # anyway, as a token for the API server must never pass here.
        if status.audiences is not None and self.audience not in status.audiences:
            raise Unauthenticated(f"the token was not issued for audience {self.audience!r}")
        user = status.user
        return Identity(
            username=user.username or "",
            uid=user.uid or "",
            groups=tuple(user.groups or ()),
            extra=tuple(sorted((key, tuple(values or ())) for key, values in (user.extra or {}).items())),
        )

    def missing_rights(self) -> list[str]:
        """The reviews this server may not ask for, by its own account's rights (asked once
        at start, to say so in the log rather than in every refused client's error)."""
        missing = []
        for group, resource in (
            ("authentication.k8s.io", "tokenreviews"),
            ("authorization.k8s.io", "subjectaccessreviews"),
        ):
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(group=group, resource=resource, verb="create")
                )
            )
            try:
                answer = self._authorization.create_self_subject_access_review(
                    review, _request_timeout=REVIEW_TIMEOUT_S
                )
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
                return [f"cannot ask the API server: {_failure(error)}"]
            if answer.status is None or not answer.status.allowed:
                missing.append(f"create {resource}.{group}")
        return missing

    def allows(self, identity: Identity, verb: Verb, queue: str) -> bool:
        review = client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=identity.username,
                uid=identity.uid or None,
                groups=list(identity.groups),
                extra={key: list(values) for key, values in identity.extra} or None,
                resource_attributes=client.V1ResourceAttributes(
                    group=ACCESS_GROUP,
                    resource=ACCESS_RESOURCE,
                    verb=verb.value,
                    namespace=self.namespace,
                    name=queue or None,
                ),
            )
        )
        try:
            answer = self._authorization.create_subject_access_review(review, _request_timeout=REVIEW_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
            raise Unavailable(f"cannot check the caller's rights now: {_failure(error)}") from None
        status = answer.status
        return status is not None and bool(status.allowed) and not status.denied


def _failure(error: Exception) -> str:
    if isinstance(error, ApiException):
        said = f"the API server answered {error.status} {error.reason}"
        if error.status == _FORBIDDEN:
            said += f" ({NEEDED_RIGHTS})"
        return said
    return f"the API server did not answer ({type(error).__name__})"


def connect_reviews(*, kubeconfig: pathlib.Path | None, namespace: str, audience: str) -> KubernetesReviews:
    """Reviews asked as the account `kubeconfig` names, or as the pod's own ServiceAccount."""
    return KubernetesReviews(connect(kubeconfig=kubeconfig), namespace=namespace, audience=audience)
