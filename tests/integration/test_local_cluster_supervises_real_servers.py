"""`shardq local up` and `status` with real server processes and real signals.

The supervisor runs as a subprocess, as a user would run it; the test kills its servers
by PID, reads the lease store and the supervisor's files, and asks `shardq local status
--json`. Every process a test saw is stopped by PID at the end, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shard_server.local.cluster_files import LEASE_STORE_DIR, PEER_SECRET_FILE
from shard_server.local.processes import is_cluster_server, process_is_alive
from shardq import Client, ShardqError
from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.fencing import isr_of
from shardq.coordination.leases import LeaseRecord
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.coordination.peer_credentials import read_peer_secret
from shardq.errors import Reason
from tests.support.ports import free_port_block
from tests.support.servers import wait_for

pytestmark = pytest.mark.slow

SERVERS = 3
QUEUE = "orders:shards=4,replicas=3"
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0


@dataclasses.dataclass
class LocalCluster:
    """`shardq local up` as a subprocess, and what a test reads from its data directory."""

    data_dir: pathlib.Path
    base_port: int
    metrics_base_port: int
    process: subprocess.Popen[bytes] | None = None
    seen_server_pids: dict[int, str] = dataclasses.field(default_factory=dict)
    runs: int = 0

    @property
    def stdout_path(self) -> pathlib.Path:
        return self.data_dir.parent / f"supervisor-{self.runs}.out"

    @property
    def stderr_path(self) -> pathlib.Path:
        return self.data_dir.parent / f"supervisor-{self.runs}.err"

    def up(self) -> None:
        self.runs += 1
        command = [
            sys.executable, "-m", "shardq", "local", "up",
            "--data-dir", str(self.data_dir),
            "--servers", str(SERVERS),
            "--queue", QUEUE,
            "--base-port", str(self.base_port),
            "--metrics-base-port", str(self.metrics_base_port),
            "--lease-duration", "2s",
        ]  # fmt: skip
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        wait_for(self._all_ready, timeout=START_DEADLINE_S, what=f"{SERVERS} servers ready\n{self.output()}")
        self.record()  # note the pids for clean-up

    def _all_ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the supervisor exited with {self.process.returncode}:\n{self.output()}")
        return f"all {SERVERS} servers ready" in self.stderr_path.read_text()

    def output(self) -> str:
        return f"--- stdout\n{self.stdout_path.read_text()}\n--- stderr\n{self.stderr_path.read_text()}"

    def endpoint_lines(self) -> list[str]:
        return [line for line in self.stdout_path.read_text().splitlines() if line.startswith("s")]

    def record(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.data_dir / "supervisor.json").read_text())
        for server_id, entry in data["servers"].items():
            self.seen_server_pids[int(entry["pid"])] = server_id
        return data

    def server_pid(self, server_id: str) -> int:
        return int(self.record()["servers"][server_id]["pid"])

    def cluster_file(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.data_dir / "cluster.json").read_text())
        return data

    def leases(self) -> dict[str, LeaseRecord]:
        with LocalLeaseStore(self.data_dir / LEASE_STORE_DIR) as store:
            return {lease.name: lease for lease in store.list("orders.")}

    def status(self) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "shardq", "local", "status", "--data-dir", str(self.data_dir), "--json"],
            capture_output=True,
            timeout=30,
            check=True,
        )
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def terminate(self) -> int:
        """SIGTERM the supervisor and wait for it; returns its exit code."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGTERM)
        return self.process.wait(timeout=STOP_DEADLINE_S)

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_DEADLINE_S)
        # Whatever the supervisor left behind: only pids that still run this cluster's servers.
        for pid, server_id in self.seen_server_pids.items():
            if is_cluster_server(pid, data_dir=self.data_dir, server_id=server_id):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    base_port, metrics_base_port = free_port_block(SERVERS)
    local = LocalCluster(data_dir=tmp_path / "cluster", base_port=base_port, metrics_base_port=metrics_base_port)
    try:
        yield local
    finally:
        local.cleanup()


def placement_leaders(cluster: LocalCluster) -> dict[str, str]:
    placement = cluster.cluster_file()["placement"]["orders"]
    return {f"orders.{index}": replicas[0] for index, replicas in enumerate(placement)}


def test_up_writes_its_files_and_starts_servers_that_answer_health_checks(cluster: LocalCluster) -> None:
    cluster.up()

    servers = cluster.cluster_file()["servers"]
    assert sorted(servers) == ["s1", "s2", "s3"]
    assert servers["s2"]["address"] == f"127.0.0.1:{cluster.base_port + 1}"
    record = cluster.record()
    assert cluster.process is not None
    assert record["pid"] == cluster.process.pid
    lines = cluster.endpoint_lines()
    assert len(lines) == SERVERS
    for line, (server_id, entry) in zip(lines, sorted(record["servers"].items()), strict=True):
        assert line.startswith(f"{server_id}  {entry['endpoint']}  pid {entry['pid']}")
        assert process_is_alive(entry["pid"])
        with grpc.insecure_channel(entry["endpoint"]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    leases = cluster.leases()
    assert {name: lease.holder for name, lease in leases.items()} == placement_leaders(cluster)
    assert all(lease.transitions == 1 and isr_of(lease) == {"s1", "s2", "s3"} for lease in leases.values())


def test_the_servers_share_a_secret_only_the_owner_reads_and_refuse_replication_calls_without_it(
    cluster: LocalCluster,
) -> None:
    cluster.up()

    path = cluster.data_dir / PEER_SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    credential = read_peer_secret(path)
    for server_id, entry in sorted(cluster.record()["servers"].items()):
        with grpc.insecure_channel(entry["endpoint"]) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetReplicaStatus(replication_pb2.GetReplicaStatusRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            answer = stub.GetReplicaStatus(
                replication_pb2.GetReplicaStatusRequest(), metadata=credential.metadata, timeout=5
            )
            assert answer.server_id == server_id


def test_status_shows_every_server_and_each_shard_with_its_leader_and_epoch(cluster: LocalCluster) -> None:
    cluster.up()
    with Client(f"127.0.0.1:{cluster.base_port}") as client:
        for number in range(40):
            client.send("orders", f"order {number}".encode())

    status = cluster.status()

    assert [(s["server_id"], s["alive"], s["answering"]) for s in status["servers"]] == [
        ("s1", True, True),
        ("s2", True, True),
        ("s3", True, True),
    ]
    assert {shard["lease"]: shard["leader"] for shard in status["shards"]} == placement_leaders(cluster)
    assert all(shard["epoch"] == 1 and shard["isr"] == ["s1", "s2", "s3"] for shard in status["shards"])
    # 40 sends spread over 4 shards: every leader has committed some of them.
    assert sum(shard["commit_index"] for shard in status["shards"]) >= 40
    assert status["supervisor_alive"] is True


def test_sigkilled_server_is_restarted_and_the_shards_it_led_fail_over_to_in_sync_replicas(
    cluster: LocalCluster,
) -> None:
    cluster.up()
    before = cluster.leases()
    victim = "s1"
    led = {name: lease for name, lease in before.items() if lease.holder == victim}
    assert led, "the placement gives every server a shard to lead"
    old_pid = cluster.server_pid(victim)

    os.kill(old_pid, signal.SIGKILL)

    def failed_over() -> bool:
        now = cluster.leases()
        return all(now[name].holder != victim for name in led)

    wait_for(failed_over, timeout=15, what=f"failover of {sorted(led)}\n{cluster.output()}")
    after = cluster.leases()
    for name, lease in led.items():
        assert after[name].transitions == lease.transitions + 1, name
        assert after[name].holder in isr_of(lease), name
    for name, lease in before.items():
        if name not in led:
            assert (after[name].holder, after[name].transitions) == (lease.holder, lease.transitions), name

    new_pid = wait_for(
        lambda: (pid := cluster.server_pid(victim)) != old_pid and process_is_alive(pid) and pid,
        timeout=15,
        what=f"a new {victim} process\n{cluster.output()}",
    )
    assert f"restarted {victim} (pid {new_pid}" in cluster.stderr_path.read_text()

    def status_agrees() -> bool:
        status = cluster.status()
        shards = {shard["lease"]: (shard["leader"], shard["epoch"]) for shard in status["shards"]}
        server = next(s for s in status["servers"] if s["server_id"] == victim)
        expected = {name: (lease.holder, lease.transitions) for name, lease in cluster.leases().items()}
        return shards == expected and server["pid"] == new_pid and server["answering"]

    wait_for(status_agrees, timeout=15, interval=0.5, what="status showing the new leaders and pid")


def test_sigterm_stops_every_server_it_started_and_exits_cleanly(cluster: LocalCluster) -> None:
    cluster.up()
    victim_pid = cluster.server_pid("s2")
    os.kill(victim_pid, signal.SIGKILL)
    wait_for(
        lambda: cluster.server_pid("s2") != victim_pid and process_is_alive(cluster.server_pid("s2")),
        timeout=15,
        what="s2 restarted",
    )
    started = dict(cluster.seen_server_pids)

    assert cluster.terminate() == 0

    assert [pid for pid in started if process_is_alive(pid)] == []
    assert not (cluster.data_dir / "supervisor.json").exists()
    assert "all servers stopped" in cluster.stderr_path.read_text()


def test_up_again_on_the_same_data_dir_keeps_the_placement_and_opens_new_epochs(cluster: LocalCluster) -> None:
    cluster.up()
    placement = cluster.cluster_file()["placement"]
    with Client(f"127.0.0.1:{cluster.base_port}") as client:
        sent = {client.send("orders", f"order {number}".encode()).message_id for number in range(20)}
    assert cluster.terminate() == 0
    # Read once every server has stopped: a stopping leader hands its shards to a
    # follower in a new epoch, so the last epochs used are those after the stop.
    first = cluster.leases()

    cluster.up()

    assert cluster.cluster_file()["placement"] == placement
    second = cluster.leases()
    for name, lease in first.items():
        # Every server process is new: no lease may keep an epoch a previous process used.
        assert second[name].transitions == lease.transitions + 1, name
        # The supervisor's rule for a restarted cluster: the placement leader if the ISR
        # vouches for it, else the last holder (stopping leaders hand their shards off).
        preferred = placement_leaders(cluster)[name]
        expected = preferred if preferred in isr_of(lease) else lease.holder
        assert second[name].holder == expected, name
    with Client(f"127.0.0.1:{cluster.base_port + 2}") as client:
        received: set[str] = set()

        def everything_received() -> bool:
            batch = client.receive_messages("orders", max_messages=100, visibility_timeout_ms=60_000)
            received.update(message.message_id for message in batch)
            return len(received) >= len(sent)

        wait_for(everything_received, timeout=15, interval=0.2, what="the messages sent before the restart")
    assert received == sent


def test_a_second_supervisor_on_the_same_data_dir_is_refused(cluster: LocalCluster) -> None:
    cluster.up()
    result = subprocess.run(
        [sys.executable, "-m", "shardq", "local", "up", "--data-dir", str(cluster.data_dir), "--queue", QUEUE],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    assert b"already runs the cluster" in result.stderr
    assert cluster.process is not None
    assert cluster.record()["pid"] == cluster.process.pid


def test_an_unusable_peer_secret_stops_up_and_status_naming_the_file(tmp_path: pathlib.Path) -> None:
    base_port, metrics_base_port = free_port_block(2)
    data_dir = tmp_path / "cluster"
    data_dir.mkdir()
    (data_dir / PEER_SECRET_FILE).write_text("tooshort")
    up = [
        sys.executable, "-m", "shardq", "local", "up", "--data-dir", str(data_dir), "--servers", "2",
        "--base-port", str(base_port), "--metrics-base-port", str(metrics_base_port), "--queue", "q:replicas=2",
    ]  # fmt: skip
    result = subprocess.run(up, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    assert f"{data_dir / PEER_SECRET_FILE}: a peer secret has at least 32 characters" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (data_dir / "servers").exists()  # no server was started
    status = [sys.executable, "-m", "shardq", "local", "status", "--data-dir", str(data_dir)]
    result = subprocess.run(status, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    assert "a peer secret has at least 32 characters" in result.stderr


def test_a_port_in_use_stops_up_at_once_naming_the_server_and_port(tmp_path: pathlib.Path) -> None:
    """The server that could not listen was restarted with back-off for good, and `up`
    never said why nor exited."""
    base_port, metrics_base_port = free_port_block(2)
    data_dir = tmp_path / "cluster"
    command = [
        sys.executable, "-m", "shardq", "local", "up", "--data-dir", str(data_dir), "--servers", "2",
        "--base-port", str(base_port), "--metrics-base-port", str(metrics_base_port), "--queue", "q:replicas=2",
    ]  # fmt: skip
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base_port + 1))
        holder.listen()
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    assert f"s2's gRPC address 127.0.0.1:{base_port + 1}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing was written that would keep the taken port for the next `up`.
    assert not (data_dir / "cluster.json").exists()


def test_a_paused_leader_loses_its_shards_once_its_leases_expire(cluster: LocalCluster) -> None:
    cluster.up()
    before = cluster.leases()
    victim = "s2"
    led = {name: lease for name, lease in before.items() if lease.holder == victim}
    pid = cluster.server_pid(victim)

    os.kill(pid, signal.SIGSTOP)
    try:
        # Nobody may take a lease from a running holder before it expired (2 s unrenewed).
        paused_at = time.monotonic()
        wait_for(
            lambda: all(cluster.leases()[name].holder != victim for name in led),
            timeout=15,
            what=f"failover of {sorted(led)} from the paused {victim}\n{cluster.output()}",
        )
        assert time.monotonic() - paused_at >= 1.5
    finally:
        os.kill(pid, signal.SIGCONT)
    after = cluster.leases()
    for name, lease in led.items():
        assert after[name].transitions == lease.transitions + 1, name
    assert "(lease-expired)" in cluster.stderr_path.read_text()
    # Paused, not dead: the supervisor leaves the process alone.
    assert cluster.server_pid(victim) == pid
    assert process_is_alive(pid)


# Sends in a loop until killed; a send that fails while a shard changes hands is skipped,
# since this load only has to exist (routing across hand-overs is tested elsewhere).
PRODUCER = """
import sys
from shardq import Client
from shardq.errors import ShardqError
with Client(sys.argv[1]) as client:
    number = 0
    while True:
        try:
            client.send("orders", b"order %d" % number)
        except ShardqError:
            pass
        number += 1
"""


def test_leadership_moves_off_a_server_that_leads_more_than_its_share_of_load(cluster: LocalCluster) -> None:
    cluster.up()
    # After s1 dies its two shards go to s2 and s3, which then lead two shards each while
    # the restarted s1 leads none: under even load, s1 should get leadership back.
    os.kill(cluster.server_pid("s1"), signal.SIGKILL)
    wait_for(lambda: all(lease.holder != "s1" for lease in cluster.leases().values()), timeout=15, what="failover")
    wait_for(lambda: cluster.stderr_path.read_text().count("s1 ready") >= 2, timeout=30, what="s1 back")
    # The takeovers dropped the dead s1 from the ISR; its leaders re-admit it once caught up.
    wait_for(
        lambda: all("s1" in isr_of(lease) for lease in cluster.leases().values()),
        timeout=30,
        what="s1 back in every ISR",
    )
    before = cluster.leases()

    # In its own process, so that a client call that never returns cannot hang the test.
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, f"127.0.0.1:{cluster.base_port + 2}"], stdin=subprocess.DEVNULL
    )
    try:
        wait_for(
            lambda: any(lease.holder == "s1" for lease in cluster.leases().values()),
            timeout=40,
            interval=0.25,
            what=f"a leadership move to s1\n{cluster.output()}",
        )
    finally:
        producer.kill()
        producer.wait(timeout=STOP_DEADLINE_S)

    after = cluster.leases()
    moved = [name for name, lease in after.items() if lease.holder == "s1"]
    for name in moved:
        assert before[name].holder != "s1", name
        assert after[name].transitions == before[name].transitions + 1, name
        assert "s1" in isr_of(before[name]), name
    assert "(rebalance)" in cluster.stderr_path.read_text()


def endpoints(cluster: LocalCluster) -> list[str]:
    return [f"127.0.0.1:{cluster.base_port + offset}" for offset in range(SERVERS)]


def every_server_lists(cluster: LocalCluster, queue: str, *, present: bool) -> bool:
    for endpoint in endpoints(cluster):
        with Client(endpoint) as client:
            if (queue in client.list_queues()) != present:
                return False
    return True


def test_a_queue_created_through_one_server_reaches_every_server_and_the_supervisor(cluster: LocalCluster) -> None:
    cluster.up()
    first, second, third = endpoints(cluster)
    with Client(first) as client:
        client.create_queue("payments", {"shards": "2", "replicas": "3"})

    placement = cluster.cluster_file()["placement"]["payments"]
    assert len(placement) == 2
    assert all(sorted(replicas) == ["s1", "s2", "s3"] for replicas in placement)
    with LocalLeaseStore(cluster.data_dir / LEASE_STORE_DIR) as store:
        leases = {lease.name: lease for lease in store.list("payments.")}
    assert {name: lease.holder for name, lease in leases.items()} == {
        f"payments.{index}": replicas[0] for index, replicas in enumerate(placement)
    }
    wait_for(lambda: every_server_lists(cluster, "payments", present=True), timeout=15, what="payments everywhere")

    bodies = {f"payment {number}".encode() for number in range(30)}
    with Client(third) as producer:
        for body in sorted(bodies):
            producer.send("payments", body)
    with Client(first, route_directly=False) as looker:
        # A peek through one server shows what every shard's leader holds, oldest first.
        peeked = wait_for(
            lambda: (found := looker.peek_messages("payments", max_messages=50)) and len(found) == 30 and found,
            timeout=10,
            what="a peek showing all 30 payments",
        )
        assert {message.body for message in peeked} == bodies
        assert [m.sent_at_ms for m in peeked] == sorted(m.sent_at_ms for m in peeked)
        assert {message.shard for message in peeked} == {0, 1}
    received: set[bytes] = set()
    with Client(second) as consumer:

        def drained() -> bool:
            for message in consumer.receive_messages("payments", max_messages=10, wait_time_ms=200):
                received.add(message.body)
                consumer.delete_messages("payments", [message.receipt])
            return received == bodies

        wait_for(drained, timeout=30, what="every payment received through another server")

    # The supervisor follows the map: the new queue's shards fail over like the others.
    victim = leases["payments.0"].holder
    os.kill(cluster.server_pid(victim), signal.SIGKILL)

    def failed_over() -> LeaseRecord | None:
        with LocalLeaseStore(cluster.data_dir / LEASE_STORE_DIR) as store:
            lease = store.get("payments.0")
        return lease if lease is not None and lease.holder != victim else None

    taken = wait_for(failed_over, timeout=20, what=f"payments.0 failing over from {victim}\n{cluster.output()}")
    assert taken.transitions == leases["payments.0"].transitions + 1
    assert "queues added ['payments']" in cluster.stderr_path.read_text()


def test_settings_changes_and_deletion_reach_every_server_and_a_recreated_queue_opens_new_epochs(
    cluster: LocalCluster,
) -> None:
    cluster.up()
    first, second, third = endpoints(cluster)
    with Client(first) as client:
        client.create_queue("audit", {"shards": "1", "visibility_timeout": "30s"})
        client.send("audit", b"kept until deleted")
    wait_for(lambda: every_server_lists(cluster, "audit", present=True), timeout=15, what="audit everywhere")

    with Client(second) as client:
        client.set_queue_attributes("audit", {"visibility_timeout": "45s"})
        with pytest.raises(ShardqError, match="cannot change"):
            client.set_queue_attributes("audit", {"shards": "4"})

    def every_server_sees_45s() -> bool:
        for endpoint in endpoints(cluster):
            with Client(endpoint) as client:
                if client.queue_settings("audit").get("visibility_timeout_ms") != 45_000:
                    return False
        return True

    wait_for(every_server_sees_45s, timeout=15, what="the new visibility timeout on every server")
    assert cluster.cluster_file()["queues"][-1]["spec"] == {"shards": "1", "visibility_timeout": "45s"}

    with LocalLeaseStore(cluster.data_dir / LEASE_STORE_DIR) as store:
        epoch_before = store.get("audit.0")
    assert epoch_before is not None
    with Client(third) as client:
        assert client.delete_queue("audit") == 1
    wait_for(lambda: every_server_lists(cluster, "audit", present=False), timeout=15, what="audit gone everywhere")
    assert "audit" not in cluster.cluster_file()["placement"]
    wait_for(
        lambda: not any((cluster.data_dir / "servers" / s / "queues" / "audit").exists() for s in ("s1", "s2", "s3")),
        timeout=15,
        what="audit's data removed on every server",
    )

    with Client(first) as client:
        client.create_queue("audit", {"shards": "1"})
        wait_for(lambda: every_server_lists(cluster, "audit", present=True), timeout=15, what="audit again")
        assert client.receive_messages("audit", max_messages=10, wait_time_ms=500) == []
    with LocalLeaseStore(cluster.data_dir / LEASE_STORE_DIR) as store:
        epoch_after = store.get("audit.0")
    assert epoch_after is not None
    assert epoch_after.transitions > epoch_before.transitions


def test_a_broken_or_impossible_map_edit_leaves_the_servers_running_as_they_were(cluster: LocalCluster) -> None:
    cluster.up()
    path = cluster.data_dir / "cluster.json"
    good = path.read_text()
    pids = {server: cluster.server_pid(server) for server in ("s1", "s2", "s3")}
    with Client(endpoints(cluster)[0]) as client:
        client.send("orders", b"before")
        path.write_text("{not json")
        time.sleep(2.5)  # servers read the map once a second
        client.send("orders", b"while broken")
        shrunk = json.loads(good)
        shrunk["queues"][0]["spec"]["shards"] = 2
        shrunk["placement"]["orders"] = shrunk["placement"]["orders"][:2]
        path.write_text(json.dumps(shrunk))
        time.sleep(2.5)
        client.send("orders", b"after")
        assert len(client.describe("orders")) == 4  # the shard count did not change under a running queue
    assert {server: cluster.server_pid(server) for server in pids} == pids  # nobody restarted
    assert all(process_is_alive(pid) for pid in pids.values())
    for server in pids:
        log = (cluster.data_dir / "logs" / f"{server}.log").read_text()
        assert "is not valid" in log, server
        assert "queue orders not changed: shards cannot change on a running queue" in log, server


# Takes the map's lock as a server changing the map does, says so, and stops itself: a
# process stopped (SIGSTOP, a debugger) in the middle of a change.
HOLD_THE_MAP_LOCK = """
import fcntl, os, signal, sys
lock = open(sys.argv[1], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_process_stopped_holding_the_map_lock_fails_queue_changes_with_its_name_not_forever(
    cluster: LocalCluster,
) -> None:
    cluster.up()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_MAP_LOCK, str(cluster.data_dir / ".cluster.json.lock")],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n"
        wait_for(
            lambda: pathlib.Path(f"/proc/{holder.pid}/stat").read_text().split(")")[1].split()[0] == "T",
            timeout=5,
            what="the lock's holder stopped",
        )
        with Client(endpoints(cluster)[0]) as client:
            started = time.monotonic()
            with pytest.raises(ShardqError) as refused:
                client.create_queue("audit", {"shards": "1"})
            waited = time.monotonic() - started
            # A delete, which is not idempotent, is told the same, not OUTCOME_UNKNOWN.
            with pytest.raises(ShardqError) as delete_refused:
                client.delete_queue("orders")
        for error in (refused.value, delete_refused.value):
            assert error.reason is Reason.CLUSTER_MAP_LOCKED, error
            assert f"held by process {holder.pid}" in error.message, error.message
            assert "the queue was not changed" in error.message
        # It waited for the lock a while, not for good (the call's own deadline is 30 s).
        assert waited < 20, waited
        assert "audit" not in cluster.cluster_file()["placement"]
        assert "orders" in cluster.cluster_file()["placement"]
    finally:
        holder.kill()  # its lock goes with it
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
    # The refused change left nothing held: the same server makes it now.
    with Client(endpoints(cluster)[0]) as client:
        client.create_queue("audit", {"shards": "1"})
    wait_for(lambda: every_server_lists(cluster, "audit", present=True), timeout=15, what="audit everywhere")
