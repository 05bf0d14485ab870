"""The watched Kubernetes lease store on a real API server: reads cost no requests, and a
watch the API server ends, drops or answers with 410 Gone recovers without missing a takeover."""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from shardq.coordination.fencing import build_takeover
from shardq.coordination.kubernetes_leases import KubernetesLeaseStore, connect
from shardq.coordination.leases import LeaseRecord
from tests.support.servers import wait_for

pytestmark = pytest.mark.controlplane

DURATION_MS = 10_000
# How long a takeover may take to reach a watching store: events arrive in milliseconds;
# the bound only keeps a broken watch from hanging the test.
SEEN_WITHIN_S = 5.0


@pytest.fixture
def rival(kubeconfig: pathlib.Path, namespace: str) -> Iterator[KubernetesLeaseStore]:
    """Another server's store, writing the takeovers the watching store must see."""
    with connect(kubeconfig=kubeconfig) as api:
        store = KubernetesLeaseStore(api, namespace=namespace, watch=False)
        yield store
        store.close()


def watching(api_client: client.ApiClient, namespace: str, **options: int) -> KubernetesLeaseStore:
    store = KubernetesLeaseStore(api_client, namespace=namespace, **options)  # type: ignore[arg-type]
    assert store.wait_until_watching(10), "the watch never started"
    return store


def take_over(rival: KubernetesLeaseStore, name: str, holder: str) -> LeaseRecord:
    current = rival.get(name)
    assert current is not None
    return rival.update(
        build_takeover(current, new_holder=holder, now_ms=current.renew_time_ms + 1, duration_ms=DURATION_MS)
    )


def sees(store: KubernetesLeaseStore, expected: LeaseRecord) -> None:
    wait_for(
        lambda: store.get(expected.name) == expected,
        timeout=SEEN_WITHIN_S,
        interval=0.01,
        what=f"epoch {expected.transitions} of {expected.name} held by {expected.holder}",
    )


def watching_again(store: KubernetesLeaseStore, watches_before: int) -> bool:
    return store.watches_started > watches_before


def test_reads_come_from_the_watch_and_see_every_takeover(
    api_client: client.ApiClient, namespace: str, rival: KubernetesLeaseStore
) -> None:
    rival.create(LeaseRecord(name="orders.0"))
    store = watching(api_client, namespace)
    try:
        for epoch in range(1, 11):
            taken = take_over(rival, "orders.0", f"s{epoch % 3 + 1}")
            assert taken.transitions == epoch
            sees(store, taken)
        for _ in range(1_000):
            store.get("orders.0")
            store.list("orders.")
        # One list and one watch; a thousand reads cost the API server nothing.
        assert store.requests == {"list": 1, "watch": 1}
    finally:
        store.close()


def test_a_watch_the_api_server_ends_resumes_without_a_relist_or_a_missed_takeover(
    api_client: client.ApiClient, namespace: str, rival: KubernetesLeaseStore
) -> None:
    rival.create(LeaseRecord(name="orders.0"))
    # The API server closes each watch after one second: several close during the test.
    store = watching(api_client, namespace, watch_timeout_seconds=1)
    try:
        for epoch in range(1, 9):
            taken = take_over(rival, "orders.0", f"s{epoch % 3 + 1}")
            sees(store, taken)
            time.sleep(0.6)  # so that takeovers fall on both sides of the watches' ends
        assert store.watches_started >= 4
        assert store.relists == 1  # each resumed from the version it had seen
        assert store.requests["get"] == 0  # and no read fell back to a request
    finally:
        store.close()


def test_a_dropped_watch_connection_resumes_and_sees_what_happened_meanwhile(
    api_client: client.ApiClient, namespace: str, rival: KubernetesLeaseStore
) -> None:
    rival.create(LeaseRecord(name="orders.0"))
    store = watching(api_client, namespace)
    try:
        for epoch in range(1, 4):
            started = store.watches_started
            store._close_response()  # the connection drops under the reader
            taken = take_over(rival, "orders.0", f"s{epoch}")
            sees(store, taken)
            wait_for(functools.partial(watching_again, store, started), timeout=10, what="the watch to resume")
        assert store.relists == 1
    finally:
        store.close()


def test_a_watch_from_a_compacted_version_relists_and_misses_no_takeover(
    api_client: client.ApiClient,
    namespace: str,
    rival: KubernetesLeaseStore,
    compact_etcd_history: Callable[[], int],
) -> None:
    rival.create(LeaseRecord(name="orders.0"))
    rival.create(LeaseRecord(name="orders.1"))
    store = watching(api_client, namespace)
    try:
        wait_for(lambda: len(store.list("orders.")) == 2, timeout=SEEN_WITHIN_S, what="both leases")
        seen_before = store._resume_version
        assert seen_before
        # While the store is away, takeovers happen and etcd compacts its history (the
        # API server does so every five minutes): the version the store would resume
        # from is gone, and the API server answers the resumed watch with 410 Gone.
        first = take_over(rival, "orders.0", "s2")
        second = take_over(rival, "orders.1", "s3")
        compact_etcd_history()
        store._resume_from(seen_before)  # the disconnection: its watch resumes from what it had seen
        wait_for(lambda: store.relists >= 2, timeout=10, what="a relist after 410 Gone")
        sees(store, first)
        sees(store, second)
        third = take_over(rival, "orders.0", "s1")
        sees(store, third)  # and the watch after the relist works
    finally:
        store.close()


def test_a_deleted_lease_disappears_from_the_watched_copy(
    api_client: client.ApiClient, namespace: str, rival: KubernetesLeaseStore
) -> None:
    rival.create(LeaseRecord(name="orders.0"))
    store = watching(api_client, namespace)
    try:
        wait_for(lambda: store.get("orders.0") is not None, timeout=SEEN_WITHIN_S, what="the lease")
        client.CoordinationV1Api(api_client).delete_namespaced_lease("orders.0", namespace)
        wait_for(lambda: store.get("orders.0") is None, timeout=SEEN_WITHIN_S, interval=0.01, what="the deletion")
        assert store.list("") == []
    finally:
        store.close()
