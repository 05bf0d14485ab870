"""Waiting for a StatefulSet's rolling update to have replaced every pod it had."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client

from e2e.polling import wait_for


def pod_uids(pods: list[Any]) -> dict[str, str]:
    return {pod.metadata.name: pod.metadata.uid for pod in pods}


def wait_every_pod_replaced(
    apps: client.AppsV1Api,
    namespace: str,
    statefulset: str,
    pods: Callable[[], list[Any]],
    before: dict[str, str],
    *,
    timeout: float,
    explain: Callable[[], str] | None = None,
) -> None:
    """After a pod-template change: wait until the StatefulSet is at its new revision and
    every pod of `before` (`pod_uids`, taken before the change, since the first pod may
    go at once) has been replaced by one of the same name, with a new UID."""

    def rolled() -> bool:
        status = apps.read_namespaced_stateful_set(statefulset, namespace).status
        now = pod_uids(pods())
        return (
            status.update_revision == status.current_revision
            and (status.updated_replicas or 0) == len(before)
            and set(now) == set(before)
            and all(now[name] != uid for name, uid in before.items())
        )

    wait_for(rolled, timeout=timeout, interval=1.0, what="every pod replaced", explain=explain)
