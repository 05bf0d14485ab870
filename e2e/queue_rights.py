"""Rights on shardq queues as users grant them, for tests and benchmarks on a real API
server: a Role allowing verbs on shardq.io queues, bound to a ServiceAccount, and tokens
from the TokenRequest API (what a projected serviceAccountToken volume holds)."""

from __future__ import annotations

from kubernetes import client

# Every verb a server with --client-auth kubernetes asks about (shard_server.domain.client_access).
EVERY_VERB = ["send", "receive", "get", "list", "admin", "export"]


def grant(api: client.ApiClient, namespace: str, account: str, *, queue: str | None, verbs: list[str]) -> str:
    """A Role allowing `verbs` on shardq.io queues (named `queue`, or all), bound to the
    ServiceAccount `account`; returns the Role's (and its binding's) name."""
    rbac = client.RbacAuthorizationV1Api(api)
    name = f"{account}-{'-'.join(verbs)}-{queue or 'all'}"
    rule = client.V1PolicyRule(api_groups=["shardq.io"], resources=["queues"], verbs=verbs)
    if queue is not None:
        rule.resource_names = [queue]
    rbac.create_namespaced_role(namespace, client.V1Role(metadata=client.V1ObjectMeta(name=name), rules=[rule]))
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=account, namespace=namespace)],
        ),
    )
    return name


def account_token(
    api: client.ApiClient, namespace: str, account: str, *, audiences: list[str] | None, seconds: int = 3600
) -> str:
    """A fresh token for `account` (audiences None: the API server's own, as a pod's
    default token has)."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=audiences or [], expiration_seconds=seconds)
    )
    answer = client.CoreV1Api(api).create_namespaced_service_account_token(account, namespace, request)
    return str(answer.status.token)
