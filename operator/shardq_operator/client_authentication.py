"""Client authentication as a ShardqCluster asks for it (pure): the servers' flags, and
whether the servers' ClusterRoleBinding to system:auth-delegator should exist.

With `spec.clientAuthentication.mode: kubernetes` the servers review each caller's
ServiceAccount token (TokenReview) and authorise its verb on the queue
(SubjectAccessReview), as their own ServiceAccount: that account needs the rights of
the built-in ClusterRole system:auth-delegator, and only a ClusterRoleBinding can grant
them (the reviews are cluster-scoped). A namespaced ShardqCluster cannot own that binding,
so the operator removes it itself: when the mode goes back to none, and when the cluster
is deleted.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DEFAULT_AUDIENCE = "shardq"


class ClientAuthMode(enum.StrEnum):
    """`spec.clientAuthentication.mode`, as users write it."""

    NONE = "none"
    KUBERNETES = "kubernetes"


@dataclasses.dataclass(frozen=True)
class ClientAuthentication:
    mode: ClientAuthMode = ClientAuthMode.NONE
    # The audience clients' tokens must be issued for (`--token-audience`).
    audience: str = DEFAULT_AUDIENCE


class DelegationStep(enum.Enum):
    """What to do about a cluster's ClusterRoleBinding to system:auth-delegator this pass."""

    APPLY = "apply"
    KEEP = "keep"
    REMOVE = "remove"


def client_authentication(cluster: Mapping[str, Any]) -> ClientAuthentication:
    """The setting of a ShardqCluster (as read from the API, defaults filled in by the CRD;
    an object from before the field existed reads as none)."""
    setting = cluster.get("spec", {}).get("clientAuthentication") or {}
    # The CRD admits only these two modes: anything else is an object that bypassed it.
    mode = ClientAuthMode.KUBERNETES if setting.get("mode") == ClientAuthMode.KUBERNETES else ClientAuthMode.NONE
    return ClientAuthentication(mode=mode, audience=str(setting.get("audience") or DEFAULT_AUDIENCE))


def server_args(setting: ClientAuthentication) -> list[str]:
    """The `shardq serve` flags for `setting` (none for mode none: the server's default)."""
    if setting.mode is ClientAuthMode.NONE:
        return []
    return ["--client-auth", setting.mode.value, "--token-audience", setting.audience]


def servers_authenticating(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The pods whose server runs with `--client-auth kubernetes` (by their spec: a pod's
    arguments are fixed for its life), sorted."""
    found = []
    for pod in pods:
        for container in pod.get("spec", {}).get("containers") or []:
            if container.get("name") != "server":
                continue
            args = list(container.get("args") or [])
            if any(
                arg == "--client-auth" and args[index + 1 : index + 2] == [ClientAuthMode.KUBERNETES]
                for index, arg in enumerate(args)
            ):
                found.append(str(pod.get("metadata", {}).get("name", "")))
    return sorted(found)


def choose_delegation_step(
    setting: ClientAuthentication, *, cluster_deleting: bool, authenticating: Sequence[str]
) -> DelegationStep:
    """Apply the binding while the cluster authenticates its clients. A cluster being
    deleted keeps what it has: its servers go on serving its remaining Queues, and the
    deletion handler removes the binding once they are gone (made anew here, it could
    outlive the cluster). After the mode goes back to none, the binding stays until no
    server still runs with client authentication: the StatefulSet restarts its pods one
    by one, and those not restarted yet would refuse every client if they could no
    longer have tokens reviewed."""
    if cluster_deleting:
        return DelegationStep.KEEP
    if setting.mode is ClientAuthMode.KUBERNETES:
        return DelegationStep.APPLY
    return DelegationStep.KEEP if authenticating else DelegationStep.REMOVE
