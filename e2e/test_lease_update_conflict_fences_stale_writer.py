"""Optimistic concurrency on a coordination.k8s.io/v1 Lease: of two concurrent updates
made from the same resourceVersion exactly one wins and the other gets 409 Conflict.
Shard fencing relies on this: a stale leader cannot overwrite a newer holder."""

from __future__ import annotations

import contextlib
import datetime
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.kubecluster import ControlPlane

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

ROUNDS = 5


def take_over(
    api: client.ApiClient,
    *,
    namespace: str,
    seen: client.V1Lease,
    holder: str,
    start: threading.Barrier,
) -> str:
    """Claim the lease as `holder` from the version `seen`: 'won', or the HTTP status."""
    claim = client.V1Lease.from_dict(seen.to_dict())
    assert claim is not None
    assert claim.spec is not None
    assert seen.metadata is not None
    claim.spec.holder_identity = holder
    claim.spec.lease_transitions = (claim.spec.lease_transitions or 0) + 1
    claim.spec.acquire_time = datetime.datetime.now(datetime.UTC)
    coordination = client.CoordinationV1Api(api)
    start.wait(timeout=10)
    try:
        coordination.replace_namespaced_lease(seen.metadata.name or "", namespace, claim)
    except ApiException as error:
        return str(error.status)
    return "won"


def test_exactly_one_of_two_concurrent_lease_updates_wins(
    control_plane: ControlPlane, api_client: client.ApiClient, namespace: str
) -> None:
    coordination = client.CoordinationV1Api(api_client)
    coordination.create_namespaced_lease(
        namespace,
        client.V1Lease(
            metadata=client.V1ObjectMeta(name="shard-0"),
            spec=client.V1LeaseSpec(holder_identity="nobody", lease_transitions=0),
        ),
    )
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(max_workers=2) as pool:
        # One client per contender: each its own connection pool, as two pods would be.
        contenders = [stack.enter_context(control_plane.api_client()) for _ in range(2)]
        for round_number in range(ROUNDS):
            seen = coordination.read_namespaced_lease("shard-0", namespace)
            assert seen.spec is not None
            assert seen.metadata is not None
            start = threading.Barrier(len(contenders))
            futures = [
                pool.submit(
                    take_over,
                    api,
                    namespace=namespace,
                    seen=seen,
                    holder=f"pod-{index}",
                    start=start,
                )
                for index, api in enumerate(contenders)
            ]
            outcomes = [future.result(timeout=30) for future in futures]

            assert sorted(outcomes) == ["409", "won"], f"round {round_number}: {outcomes}"
            after = coordination.read_namespaced_lease("shard-0", namespace)
            assert after.spec is not None
            assert after.metadata is not None
            assert after.spec.holder_identity == f"pod-{outcomes.index('won')}"
            assert after.spec.lease_transitions == (seen.spec.lease_transitions or 0) + 1
            assert after.metadata.resource_version != seen.metadata.resource_version
