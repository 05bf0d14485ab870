"""One contract for every LeaseStore: the local lease directory and Kubernetes Leases behave alike.

Subclass LeaseStoreContract and provide `store` and `rival_store` (a second handle on the
same leases, as another server would hold); every test runs on each implementation.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.synchronize
import os
import pathlib
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import lmdb
import pytest
from kubernetes import client

from shardq.coordination import local_leases
from shardq.coordination.fencing import build_isr_change, build_renewal, build_takeover, isr_of
from shardq.coordination.kubernetes_leases import KubernetesLeaseStore, connect
from shardq.coordination.leases import ISR_ANNOTATION, LeaseConflict, LeaseRecord, LeaseStore
from shardq.coordination.local_leases import LocalLeaseStore
from tests.support.servers import wait_for

# Wall-clock milliseconds with a sub-second part, so a store that kept only seconds fails.
T0 = 1_763_771_298_123
DURATION_MS = 1_500
RACE_ROUNDS = 5


def fresh(name: str = "orders-0") -> LeaseRecord:
    return LeaseRecord(name=name, annotations={"team": "payments"})


def race(stores: list[LeaseStore], seen: LeaseRecord) -> list[str]:
    """Every store takes over `seen` at the same moment; each reports 'won' or 'conflict'."""
    start = threading.Barrier(len(stores))

    def contend(index: int, store: LeaseStore) -> str:
        claim = build_takeover(seen, new_holder=f"server-{index}", now_ms=T0, duration_ms=DURATION_MS)
        start.wait(timeout=10)
        try:
            store.update(claim)
        except LeaseConflict:
            return "conflict"
        return "won"

    with ThreadPoolExecutor(max_workers=len(stores)) as pool:
        futures = [pool.submit(contend, index, store) for index, store in enumerate(stores)]
        return [future.result(timeout=30) for future in futures]


class LeaseStoreContract:
    def test_created_lease_reads_back_exactly(self, store: LeaseStore) -> None:
        record = LeaseRecord(
            name="orders-0",
            holder="server-1",
            acquire_time_ms=T0,
            renew_time_ms=T0 + 250,
            duration_ms=DURATION_MS,
            transitions=3,
            annotations={"team": "payments"},
        )
        created = store.create(record)

        assert created.version
        assert created == dataclasses.replace(record, version=created.version)
        assert store.get("orders-0") == created

    @pytest.mark.parametrize(
        ("acquire_time_ms", "duration_ms"),
        [(1_763_771_298_000, 1_000), (1_763_771_298_001, 999), (1_763_771_298_999, 15_001)],
        ids=["whole-second", "one-ms-past", "one-ms-short"],
    )
    def test_times_and_durations_keep_every_millisecond(
        self, store: LeaseStore, acquire_time_ms: int, duration_ms: int
    ) -> None:
        created = store.create(
            build_takeover(fresh(), new_holder="server-1", now_ms=acquire_time_ms, duration_ms=duration_ms)
        )
        renewed = store.update(build_renewal(created, now_ms=acquire_time_ms + 1_000))

        stored = store.get("orders-0")
        assert stored == renewed
        assert (stored.acquire_time_ms, stored.renew_time_ms, stored.duration_ms) == (
            acquire_time_ms,
            acquire_time_ms + 1_000,
            duration_ms,
        )

    def test_unknown_lease_reads_as_none(self, store: LeaseStore) -> None:
        assert store.get("orders-9") is None

    def test_creating_an_existing_lease_conflicts_and_keeps_the_first(self, store: LeaseStore) -> None:
        first = store.create(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        with pytest.raises(LeaseConflict):
            store.create(build_takeover(fresh(), new_holder="server-2", now_ms=T0, duration_ms=DURATION_MS))
        assert store.get("orders-0") == first

    def test_update_writes_and_issues_a_new_version(self, store: LeaseStore) -> None:
        created = store.create(fresh())

        updated = store.update(build_takeover(created, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        assert updated.version != created.version
        assert updated.holder == "server-1"
        assert store.get("orders-0") == updated

    def test_update_from_a_stale_version_conflicts_and_changes_nothing(self, store: LeaseStore) -> None:
        stale = store.create(fresh())
        current = store.update(build_takeover(stale, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        with pytest.raises(LeaseConflict):
            store.update(build_takeover(stale, new_holder="server-2", now_ms=T0 + 1, duration_ms=DURATION_MS))
        assert store.get("orders-0") == current

    def test_update_without_a_version_is_refused(self, store: LeaseStore) -> None:
        store.create(fresh())

        with pytest.raises(ValueError, match="version"):
            store.update(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        stored = store.get("orders-0")
        assert stored is not None
        assert stored.holder == ""

    def test_update_of_a_missing_lease_conflicts(self, store: LeaseStore, rival_store: LeaseStore) -> None:
        elsewhere = rival_store.create(fresh("orders-1"))

        with pytest.raises(LeaseConflict):
            store.update(LeaseRecord(name="orders-0", holder="server-1", version=elsewhere.version))
        assert store.get("orders-0") is None

    def test_of_two_concurrent_updates_from_one_version_exactly_one_wins(
        self, store: LeaseStore, rival_store: LeaseStore
    ) -> None:
        store.create(fresh())
        for round_number in range(RACE_ROUNDS):
            seen = store.get("orders-0")
            assert seen is not None

            outcomes = race([store, rival_store], seen)

            assert sorted(outcomes) == ["conflict", "won"], f"round {round_number}: {outcomes}"
            after = store.get("orders-0")
            assert after is not None
            assert after.holder == f"server-{outcomes.index('won')}"
            assert after.transitions == seen.transitions + 1

    def test_takeover_opens_a_new_epoch_and_renewal_keeps_it(self, store: LeaseStore) -> None:
        created = store.create(fresh())
        taken = store.update(build_takeover(created, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        renewed = store.update(build_renewal(taken, now_ms=T0 + 500))
        retaken = store.update(
            build_takeover(renewed, new_holder="server-2", now_ms=T0 + 3_000, duration_ms=DURATION_MS)
        )

        assert [taken.transitions, renewed.transitions, retaken.transitions] == [1, 1, 2]
        assert (renewed.acquire_time_ms, renewed.renew_time_ms) == (T0, T0 + 500)
        assert (retaken.acquire_time_ms, retaken.renew_time_ms) == (T0 + 3_000, T0 + 3_000)
        assert store.get("orders-0") == retaken

    def test_isr_annotation_round_trips_beside_other_annotations(self, store: LeaseStore) -> None:
        created = store.create(fresh())
        led = store.update(build_takeover(created, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        store.update(build_isr_change(led, ["server-3", "server-1", "server-2"]))
        stored = store.get("orders-0")

        assert stored is not None
        assert isr_of(stored) == {"server-1", "server-2", "server-3"}
        assert stored.annotations == {"team": "payments", ISR_ANNOTATION: "server-1,server-2,server-3"}

    def test_list_returns_the_leases_with_the_prefix_in_name_order(self, store: LeaseStore) -> None:
        for name in ("orders-1", "payments-0", "orders-0", "ordersbig-0", "order-0"):
            store.create(fresh(name))

        assert [record.name for record in store.list("orders-")] == ["orders-0", "orders-1"]
        assert [record.name for record in store.list("pay")] == ["payments-0"]
        assert store.list("refunds-") == []
        assert [record.name for record in store.list("")] == [
            "order-0",
            "orders-0",
            "orders-1",
            "ordersbig-0",
            "payments-0",
        ]
        assert store.list("orders-") == [store.get("orders-0"), store.get("orders-1")]


def changed_since(store: LeaseStore, name: str, version: str) -> LeaseRecord | None:
    seen = store.get(name)
    return seen if seen is not None and seen.version != version else None


class TestLocalLeaseStore(LeaseStoreContract):
    @pytest.fixture
    def path(self, tmp_path: pathlib.Path) -> pathlib.Path:
        return tmp_path / "cluster" / "leases"

    @pytest.fixture
    def store(self, path: pathlib.Path) -> Iterator[LocalLeaseStore]:
        with LocalLeaseStore(path) as store:
            yield store

    @pytest.fixture
    def rival_store(self, path: pathlib.Path, store: LocalLeaseStore) -> Iterator[LocalLeaseStore]:
        # A second handle on the same directory; other processes are tested with real
        # processes below.
        with LocalLeaseStore(path) as rival:
            yield rival

    def test_leases_survive_reopening_the_store(self, path: pathlib.Path) -> None:
        with LocalLeaseStore(path) as store:
            created = store.create(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        with LocalLeaseStore(path) as reopened:
            assert reopened.get("orders-0") == created

    def test_a_writer_that_read_the_lease_long_ago_conflicts_once_its_version_is_cleaned_up(
        self, store: LocalLeaseStore, rival_store: LocalLeaseStore
    ) -> None:
        """Old versions are removed, so the name of the version after a long-gone one is
        free again: a writer that read the lease that long ago must still lose."""
        created = store.create(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        current = created
        for renewal in range(3 * local_leases.KEEP_VERSIONS):
            current = rival_store.update(build_renewal(current, now_ms=T0 + renewal + 1))

        with pytest.raises(LeaseConflict):
            store.update(build_takeover(created, new_holder="server-2", now_ms=T0, duration_ms=DURATION_MS))
        assert store.get("orders-0") == current
        assert store.update(build_renewal(current, now_ms=T0 + 1_000)).renew_time_ms == T0 + 1_000

    def test_a_record_read_before_the_directory_was_made_again_does_not_land(
        self, path: pathlib.Path, store: LocalLeaseStore
    ) -> None:
        """Its version is past every version the new directory has: linked above them, it
        would be read as the current lease."""
        current = store.create(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        for renewal in range(5):
            current = store.update(build_renewal(current, now_ms=T0 + renewal + 1))
        shutil.rmtree(path)
        with LocalLeaseStore(path) as remade:
            created = remade.create(build_takeover(fresh(), new_holder="server-2", now_ms=T0, duration_ms=DURATION_MS))

            with pytest.raises(LeaseConflict):
                remade.update(build_renewal(current, now_ms=T0 + 100))
            assert remade.get("orders-0") == created

    def test_old_versions_are_removed(self, path: pathlib.Path, store: LocalLeaseStore) -> None:
        current = store.create(build_takeover(fresh(), new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        for renewal in range(10 * local_leases.KEEP_VERSIONS):
            current = store.update(build_renewal(current, now_ms=T0 + renewal + 1))

        # A clean-up every KEEP_VERSIONS writes keeps the last KEEP_VERSIONS.
        kept = list((path / "orders-0").iterdir())
        assert 0 < len(kept) <= 2 * local_leases.KEEP_VERSIONS, sorted(entry.name for entry in kept)
        assert store.get("orders-0") == current

    def test_an_older_clusters_lmdb_lease_file_is_imported_with_its_epochs(
        self, tmp_path: pathlib.Path, store: LocalLeaseStore
    ) -> None:
        old_file = tmp_path / "leases.lmdb"
        environment = lmdb.open(str(old_file), subdir=False, max_dbs=0)
        fields = {
            "format": 1,
            "holder": "server-2",
            "acquire_time_ms": T0,
            "renew_time_ms": T0 + 250,
            "duration_ms": DURATION_MS,
            "transitions": 7,
            "annotations": {ISR_ANNOTATION: "server-1,server-2"},
            "version": 12,
        }
        with environment.begin(write=True) as txn:
            txn.put(b"orders.0", json.dumps(fields).encode())
            txn.put(b"orders.1", json.dumps(fields | {"holder": "server-1", "transitions": 3}).encode())
        environment.close()

        assert local_leases.import_lmdb_leases(old_file, store) == 2

        imported = store.get("orders.0")
        assert imported is not None
        assert (imported.holder, imported.transitions, imported.renew_time_ms) == ("server-2", 7, T0 + 250)
        assert isr_of(imported) == {"server-1", "server-2"}
        assert [(record.name, record.transitions) for record in store.list("orders.")] == [
            ("orders.0", 7),
            ("orders.1", 3),
        ]
        taken = store.update(build_takeover(imported, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))
        assert taken.transitions == 8

    @pytest.mark.timeout(60)
    def test_of_two_processes_updating_from_one_version_exactly_one_wins(
        self, path: pathlib.Path, store: LocalLeaseStore
    ) -> None:
        store.create(fresh())
        # spawn, not fork: an LMDB environment must not cross a fork.
        context = multiprocessing.get_context("spawn")
        for round_number in range(RACE_ROUNDS):
            seen = store.get("orders-0")
            assert seen is not None
            start = context.Barrier(2)
            outcomes = context.Queue()
            contenders = [
                context.Process(
                    target=take_over_in_another_process, args=(path, seen, f"server-{index}", start, outcomes)
                )
                for index in range(2)
            ]
            for process in contenders:
                process.start()
            for process in contenders:
                process.join(timeout=30)
                assert process.exitcode == 0
            results = dict(outcomes.get(timeout=5) for _ in contenders)

            assert sorted(results.values()) == ["conflict", "won"], f"round {round_number}: {results}"
            after = store.get("orders-0")
            assert after is not None
            assert results[after.holder] == "won"
            assert after.transitions == seen.transitions + 1

    @pytest.mark.timeout(120)
    def test_a_process_stopped_in_the_middle_of_its_writes_holds_up_no_other_writer(
        self, path: pathlib.Path, store: LocalLeaseStore
    ) -> None:
        """A server SIGSTOPped (a debugger, a Ctrl-Z, a frozen VM of one process) while it
        writes must not freeze every renewal and failover of the cluster: the supervisor
        has to take its leases over. Found by a fault test in CI: the supervisor stayed
        silent for 30 s after a leader was paused, blocked on the LMDB file's writer lock."""
        store.create(build_takeover(fresh("busy-0"), new_holder="busy", now_ms=T0, duration_ms=DURATION_MS))
        store.create(build_takeover(fresh("other-0"), new_holder="supervisor", now_ms=T0, duration_ms=DURATION_MS))
        context = multiprocessing.get_context("spawn")
        started = context.Event()
        done = context.Event()
        outcomes = context.Queue()
        writer = context.Process(target=renew_until_done, args=(path, "busy-0", started, done, outcomes))
        writer.start()
        rng = random.Random(7)
        ours = 0
        stuck: list[int] = []
        try:
            assert started.wait(timeout=30), "the renewing process never started"
            with ThreadPoolExecutor(max_workers=1) as pool:
                for stop in range(STOPS):
                    time.sleep(rng.uniform(0.001, 0.02))
                    os.kill(writer.pid or 0, signal.SIGSTOP)
                    # Its lease and another, as the supervisor would take them over.
                    writes = pool.submit(take_over_both, store)
                    try:
                        ours += writes.result(timeout=STOPPED_WRITE_DEADLINE_S)
                    except TimeoutError:
                        stuck.append(stop)
                    finally:
                        os.kill(writer.pid or 0, signal.SIGCONT)
                    if stuck:
                        writes.result(timeout=30)  # free once the writer goes on
                        break
        finally:
            done.set()
            writer.join(timeout=30)
        assert not stuck, f"a write waited over {STOPPED_WRITE_DEADLINE_S:g} s for a stopped process (stop {stuck[0]})"
        assert writer.exitcode == 0
        theirs = outcomes.get(timeout=5)
        busy = store.get("busy-0")
        assert busy is not None
        # Compare-and-swap held across every stop: no write was lost or doubled.
        assert int(busy.annotations.get(WRITES, "0")) == theirs + ours, (busy.annotations, theirs, ours)
        assert ours > 0, "the supervisor's takeovers never took"


STOPS = 40
STOPPED_WRITE_DEADLINE_S = 2.0
# Every write of busy-0 counts itself here, so a write lost to a broken compare-and-swap shows.
WRITES = "writes"


def counted(record: LeaseRecord) -> LeaseRecord:
    return dataclasses.replace(
        record, annotations=record.annotations | {WRITES: str(int(record.annotations.get(WRITES, "0")) + 1)}
    )


def take_over_both(store: LocalLeaseStore) -> int:
    """Take over busy-0 and other-0 as the supervisor; how many of busy-0's took (0 or 1)."""
    other = store.get("other-0")
    assert other is not None
    store.update(build_renewal(other, now_ms=T0))
    busy = store.get("busy-0")
    assert busy is not None
    try:
        store.update(counted(build_takeover(busy, new_holder="supervisor", now_ms=T0, duration_ms=DURATION_MS)))
    except LeaseConflict:
        return 0
    return 1


def renew_until_done(
    path: pathlib.Path,
    name: str,
    started: multiprocessing.synchronize.Event,
    done: multiprocessing.synchronize.Event,
    outcomes: multiprocessing.Queue[int],
) -> None:
    """Write `name` as fast as it can until `done`; put how many writes took."""
    took = 0
    with LocalLeaseStore(path) as store:
        started.set()
        while not done.is_set():
            seen = store.get(name)
            assert seen is not None
            try:
                store.update(counted(dataclasses.replace(build_renewal(seen, now_ms=T0), holder="busy")))
            except LeaseConflict:
                continue
            took += 1
    outcomes.put(took)


def take_over_in_another_process(
    path: pathlib.Path,
    seen: LeaseRecord,
    holder: str,
    start: multiprocessing.synchronize.Barrier,
    outcomes: multiprocessing.Queue[tuple[str, str]],
) -> None:
    with LocalLeaseStore(path) as store:
        claim = build_takeover(seen, new_holder=holder, now_ms=T0, duration_ms=DURATION_MS)
        start.wait(timeout=10)
        try:
            store.update(claim)
        except LeaseConflict:
            outcomes.put((holder, "conflict"))
        else:
            outcomes.put((holder, "won"))


@pytest.mark.controlplane
class TestKubernetesLeaseStore(LeaseStoreContract):
    """Reads served from the store's watch (how servers and the operator use it)."""

    watch = True

    @pytest.fixture
    def store(self, api_client: client.ApiClient, namespace: str) -> Iterator[KubernetesLeaseStore]:
        store = KubernetesLeaseStore(api_client, namespace=namespace, watch=self.watch)
        assert not self.watch or store.wait_until_watching(10)
        yield store
        store.close()

    @pytest.fixture
    def rival_store(self, kubeconfig: pathlib.Path, namespace: str) -> Iterator[LeaseStore]:
        # Its own client and connection pool, as another pod would have.
        with connect(kubeconfig=kubeconfig) as api:
            rival = KubernetesLeaseStore(api, namespace=namespace, watch=self.watch)
            yield rival
            rival.close()

    def test_update_keeps_labels_and_owners_set_by_others(
        self, store: LeaseStore, api_client: client.ApiClient, namespace: str
    ) -> None:
        created = store.create(fresh())
        leases = client.CoordinationV1Api(api_client)
        config_map = client.CoreV1Api(api_client).create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="orders"))
        )
        assert config_map.metadata is not None
        owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "orders", "uid": config_map.metadata.uid}
        leases.patch_namespaced_lease(
            "orders-0",
            namespace,
            {"metadata": {"labels": {"shardq.io/queue": "orders"}, "ownerReferences": [owner]}},
        )
        # A change made by another writer reaches a watching store one event later.
        seen = wait_for(lambda: changed_since(store, "orders-0", created.version), timeout=10, what="the patch")

        store.update(build_takeover(seen, new_holder="server-1", now_ms=T0, duration_ms=DURATION_MS))

        lease = leases.read_namespaced_lease("orders-0", namespace)
        assert lease.metadata is not None
        assert lease.spec is not None
        assert (lease.metadata.labels or {}).get("shardq.io/queue") == "orders"
        assert [reference.name for reference in lease.metadata.owner_references or []] == ["orders"]
        assert lease.spec.holder_identity == "server-1"

    def test_leases_of_other_owners_are_not_listed(
        self, store: LeaseStore, api_client: client.ApiClient, namespace: str
    ) -> None:
        client.CoordinationV1Api(api_client).create_namespaced_lease(
            namespace, client.V1Lease(metadata=client.V1ObjectMeta(name="orders-controller"))
        )
        store.create(fresh("orders-0"))

        assert [record.name for record in store.list("orders-")] == ["orders-0"]


@pytest.mark.controlplane
class TestKubernetesLeaseStoreWithoutWatch(TestKubernetesLeaseStore):
    """Every read a GET: what servers did before the watch (`--no-lease-watch`)."""

    watch = False
