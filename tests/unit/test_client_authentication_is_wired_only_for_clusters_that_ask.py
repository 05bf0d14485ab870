"""A ShardqCluster's `spec.clientAuthentication` as the operator carries it out: the
servers' flags, their ServiceAccount's binding to system:auth-delegator, and when that
cluster-scoped binding is applied, kept or removed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from shardq_operator import builders, naming
from shardq_operator.client_authentication import (
    ClientAuthentication,
    ClientAuthMode,
    DelegationStep,
    choose_delegation_step,
    client_authentication,
    servers_authenticating,
)

CLUSTER: dict[str, Any] = {
    "apiVersion": "shardq.io/v1alpha1",
    "kind": "ShardqCluster",
    "metadata": {"name": "main", "namespace": "shop", "uid": "u-1"},
    "spec": {"servers": 3},
}


def cluster_with(client_auth: dict[str, str] | None) -> dict[str, Any]:
    cluster = copy.deepcopy(CLUSTER)
    if client_auth is not None:
        cluster["spec"]["clientAuthentication"] = client_auth
    return cluster


def server_args(cluster: dict[str, Any]) -> list[str]:
    args: list[str] = builders.stateful_set(cluster, servers=3)["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("client_auth", [None, {}, {"mode": "none"}, {"mode": "none", "audience": "orders"}])
def test_servers_of_a_cluster_without_client_authentication_get_no_auth_flags(client_auth: Any) -> None:
    args = server_args(cluster_with(client_auth))
    assert "--client-auth" not in args
    assert "--token-audience" not in args
    assert client_authentication(cluster_with(client_auth)).mode is ClientAuthMode.NONE


@pytest.mark.parametrize(("audience", "expected"), [(None, "shardq"), ("orders.example.com", "orders.example.com")])
def test_servers_of_a_kubernetes_mode_cluster_review_tokens_for_its_audience(
    audience: str | None, expected: str
) -> None:
    setting = {"mode": "kubernetes", **({"audience": audience} if audience else {})}
    args = server_args(cluster_with(setting))
    assert args.count("--client-auth") == 1
    assert args[args.index("--client-auth") + 1] == "kubernetes"
    assert args.count("--token-audience") == 1
    assert args[args.index("--token-audience") + 1] == expected
    # The namespace rights are asked in is the pod's own, passed as before.
    assert args[args.index("--namespace") + 1] == "$(POD_NAMESPACE)"
    # Everything else is as without client authentication.
    flags = {args.index("--client-auth"), args.index("--token-audience")}
    rest = [arg for index, arg in enumerate(args) if index not in flags and index - 1 not in flags]
    assert rest == server_args(cluster_with(None))


def test_the_binding_gives_the_servers_account_the_auth_delegator_role_and_nothing_else() -> None:
    cluster = cluster_with({"mode": "kubernetes"})
    binding = builders.auth_delegator_binding(cluster)
    assert binding["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "system:auth-delegator",
    }
    pod_account = builders.stateful_set(cluster, servers=3)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_account, "namespace": "shop"}]
    assert pod_account == builders.service_account(cluster)["metadata"]["name"]
    metadata = binding["metadata"]
    assert metadata["name"] == "shardq:shop:main:auth-delegator"
    # Cluster-scoped: no namespace, and no owner (a namespaced owner cannot hold it).
    assert "namespace" not in metadata
    assert "ownerReferences" not in metadata
    assert metadata["labels"] == {
        "app.kubernetes.io/name": "shardq-server",
        "app.kubernetes.io/instance": "main",
        "app.kubernetes.io/managed-by": "shardq-operator",
        "shardq.io/namespace": "shop",
    }


def test_no_two_clusters_share_a_binding_name_and_none_is_too_long() -> None:
    pairs = [("a-b", "c"), ("a", "b-c"), ("shop", "main"), ("shop", "main.v2"), ("shop2", "main"), ("shop", "main2")]
    long_cluster = "c" * 253
    pairs += [("n" * 63, long_cluster), ("n" * 63, long_cluster[:-1] + "d"), ("m" * 63, long_cluster)]
    names = [naming.auth_delegator_binding(namespace, cluster) for namespace, cluster in pairs]
    assert len(set(names)) == len(pairs)
    assert all(len(name) <= naming.MAX_NAME_CHARS for name in names)
    # What RBAC refuses in a name: "/", "%", and the names "." and "..".
    assert not [name for name in names if "/" in name or "%" in name]
    assert naming.auth_delegator_binding("shop", "main") == "shardq:shop:main:auth-delegator"


def pod(name: str, args: list[str], *, container: str = "server") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": container, "args": args}]}}


def test_servers_authenticating_are_the_pods_whose_server_runs_with_kubernetes_client_auth() -> None:
    template = builders.stateful_set(cluster_with({"mode": "kubernetes"}), servers=3)["spec"]["template"]
    plain = builders.stateful_set(cluster_with(None), servers=3)["spec"]["template"]
    pods = [
        {"metadata": {"name": "main-shardq-1"}, "spec": template["spec"]},
        {"metadata": {"name": "main-shardq-0"}, "spec": template["spec"]},
        {"metadata": {"name": "main-shardq-2"}, "spec": plain["spec"]},
        pod("main-shardq-3", ["shardq", "serve", "--client-auth", "none"]),
        pod("main-shardq-4", ["shardq", "serve", "--client-auth"]),  # cut short: not running with it
        pod("sidecar-pod", ["--client-auth", "kubernetes"], container="proxy"),
    ]
    assert servers_authenticating(pods) == ["main-shardq-0", "main-shardq-1"]
    assert servers_authenticating([]) == []


KUBERNETES = ClientAuthentication(mode=ClientAuthMode.KUBERNETES)
NONE = ClientAuthentication()


@pytest.mark.parametrize(
    ("setting", "deleting", "authenticating", "step"),
    [
        (KUBERNETES, False, [], DelegationStep.APPLY),
        (KUBERNETES, False, ["main-shardq-0"], DelegationStep.APPLY),
        # Back to none: kept while a server still asks for reviews, removed after.
        (NONE, False, ["main-shardq-2"], DelegationStep.KEEP),
        (NONE, False, [], DelegationStep.REMOVE),
        # Being deleted: left to the deletion handler, never made anew.
        (KUBERNETES, True, ["main-shardq-0"], DelegationStep.KEEP),
        (NONE, True, [], DelegationStep.KEEP),
    ],
)
def test_the_binding_is_applied_kept_or_removed(
    setting: ClientAuthentication, deleting: bool, authenticating: list[str], step: DelegationStep
) -> None:
    assert choose_delegation_step(setting, cluster_deleting=deleting, authenticating=authenticating) is step
