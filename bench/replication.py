"""Replication benchmark: failover time, throughput by replica count, follower bootstrap time.

Every part runs real `python -m shardq serve` processes in cluster mode (a cluster file,
a LocalLeaseStore lease directory, one data directory per server) on free 127.0.0.1 ports,
records their PIDs and stops them by PID in `finally` blocks. Parts:

  failover    3 servers, 1 shard, replicas=3. Per trial: a producer sends continuously
              (1 message per unary call, 4 lanes) through a follower endpoint; the shard's
              leader is SIGKILLed; a supervisor loop polls the lease every 50 ms and, once
              it is expired (fencing.is_expired), takes it over for an in-sync replica
              (fencing.isr_of, fencing.build_takeover), as the operator does. Measured: kill
              -> first send acknowledged by the new leader (a call started after the kill),
              split into kill -> lease expiry -> takeover written -> first ack. The killed
              server is restarted and must be back in the ISR before the next trial.
              `--takeover-on death` takes the lease over as soon as the killed process is
              reaped instead (what `shardq local up` does when its child dies).
  throughput  bench/dataplane.py's send.single.stream, send.batch10.stream and drain.stream
              (or drain.unary: --drain unary) phases, same worker processes and measurements,
              against an N-server cluster, replicas=N, for N = 1, 2, 3; every shard led by s1,
              which is the clients' endpoint.
  bootstrap   2 servers, 1 shard, replicas=2: fill with --bootstrap-gib of 64 KiB bodies,
              stop the follower, delete its data directory, restart it and time until its
              GetReplicaStatus shows the leader's last_index and applied_index. Run with the
              default journal retention (the leader still holds the whole log: log shipping
              from index 1) and with journal_retention=1s (the leader pruned its log: the
              follower must bootstrap from a snapshot); the path taken is read from the
              follower's role while it catches up and from its log.

Usage: python bench/replication.py [failover] [throughput] [bootstrap] [--trials 20]
       [--messages 20000] [--bootstrap-gib 1] [--out bench/results] [--label default]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import dataplane  # bench/dataplane.py: this script's directory is sys.path[0]
import reports

# The benchmarks share the tests' support package (one free-port probe, one way to
# seed a cluster); run as `python bench/replication.py`, the repository is not on the path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import grpc

from shardq import event_loops
from shardq.aio import CHANNEL_OPTIONS, AsyncClient
from shardq.api.v1 import replication_pb2, replication_pb2_grpc
from shardq.coordination.cluster_map import CLUSTER_FILE, QueueEntry, lease_name
from shardq.coordination.fencing import build_isr_change, build_takeover, is_expired, isr_of
from shardq.coordination.leases import LeaseConflict, LeaseRecord
from shardq.coordination.local_leases import LocalLeaseStore
from shardq.coordination.peer_credentials import NO_PEER_SECRET, new_peer_secret, read_peer_secret, write_peer_secret
from shardq.coordination.placement import ShardId
from shardq.coordination.takeovers import Takeover, TakeoverReason, isr_after_takeover
from shardq.errors import ShardqError
from shardq.types import Message
from tests.support.clusters import seed_cluster
from tests.support.ports import free_port

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LISTENING = re.compile(rb"shardq: listening on (\S+):(\d+)")
SERVER_START_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 60.0
SUPERVISOR_POLL_S = 0.05
STATUS_POLL_S = 0.1
PRODUCER_LANES = 4
PRODUCER_RETRY_S = 0.01
PRODUCER_MAX_CALLS = 200_000
WARMUP_ACKS = 20
FIRST_ACK_TIMEOUT_S = 60.0
ISR_REJOIN_TIMEOUT_S = 30.0
BOOTSTRAP_BODY_BYTES = 64 * 1024
BOOTSTRAP_BATCH = 16
BOOTSTRAP_WINDOW = 4
PRUNE_WAIT_S = 6.0
ROLE_NAMES = {
    replication_pb2.REPLICA_ROLE_LEADER: "leader",
    replication_pb2.REPLICA_ROLE_FOLLOWER: "follower",
    replication_pb2.REPLICA_ROLE_RECOVERING: "recovering",
}


def log(text: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {text}", file=sys.stderr, flush=True)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def directory_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summary_ms(values: Sequence[float]) -> dict[str, float | int]:
    """Nearest-rank p50, and max, of millisecond values."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p50 = ordered[max(0, int(0.5 * len(ordered) + 0.5) - 1)]
    return {
        "n": len(ordered),
        "p50_ms": round(p50, 1),
        "max_ms": round(ordered[-1], 1),
        "min_ms": round(ordered[0], 1),
        "mean_ms": round(sum(ordered) / len(ordered), 1),
    }


# -- a local cluster --------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class ServerProcess:
    server_id: str
    port: int
    data_dir: pathlib.Path
    log_path: pathlib.Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster:
    """Servers from one cluster file; the benchmark plays the supervisor (it creates the
    leases and performs every takeover)."""

    def __init__(
        self,
        root: pathlib.Path,
        *,
        servers: Sequence[str],
        queue: str,
        spec: dict[str, Any],
        placement: list[list[str]],
        lease_ms: int,
        peer_secret: bool = True,
    ) -> None:
        """`peer_secret`: the servers authenticate each other, as `shardq local` and the
        operator's clusters do (off: every caller is taken for a peer)."""
        self.root = root
        self.queue = queue
        self.lease_ms = lease_ms
        self.placement = placement
        root.mkdir(parents=True, exist_ok=True)
        self.servers = {s: ServerProcess(s, free_port(), root / s, root / f"{s}.log") for s in servers}
        self.cluster_file = root / CLUSTER_FILE
        self.lease_path = root / "leases"
        self.leases = LocalLeaseStore(self.lease_path)
        self.credential = NO_PEER_SECRET
        self.secret_args: list[str] = []
        if peer_secret:
            secret_file = write_peer_secret(root / "peer-secret", new_peer_secret())
            self.credential = read_peer_secret(secret_file)
            self.secret_args = ["--peer-secret-file", str(secret_file)]
        seed_cluster(
            self.cluster_file,
            self.leases,
            servers={s: p.address for s, p in self.servers.items()},
            queue=QueueEntry(queue, spec),
            placement=placement,
            lease_duration_ms=lease_ms,
            now_ms=wall_ms(),
        )

    def lease_name(self, shard: int) -> str:
        return lease_name(ShardId(self.queue, shard))

    def lease(self, shard: int = 0) -> LeaseRecord:
        record = self.leases.get(self.lease_name(shard))
        assert record is not None
        return record

    def start(self, server_id: str) -> None:
        server = self.servers[server_id]
        command = [
            sys.executable, "-m", "shardq", "serve",
            "--cluster-file", str(self.cluster_file), "--server-id", server_id,
            "--lease-store", str(self.lease_path), "--data-dir", str(server.data_dir),
            "--host", "127.0.0.1", "--port", str(server.port), "--log-format", "text", *self.secret_args,
        ]  # fmt: skip
        offset = server.log_path.stat().st_size if server.log_path.exists() else 0
        with server.log_path.open("ab") as sink:
            server.started_at = time.monotonic()
            server.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            with server.log_path.open("rb") as source:
                source.seek(offset)
                if LISTENING.search(source.read()):
                    return
            if server.process.poll() is not None:
                break
            time.sleep(0.05)
        tail = server.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{server_id} did not start; log tail:\n{tail}")

    def start_all(self) -> None:
        for server_id in self.servers:
            self.start(server_id)

    def kill(self, server_id: str) -> None:
        server = self.servers[server_id]
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)

    def stop(self, server_id: str) -> int | None:
        process = self.servers[server_id].process
        return dataplane.stop_process(process) if process is not None else None

    def stop_all(self) -> None:
        for server in self.servers.values():
            if server.running():
                assert server.process is not None
                os.kill(server.process.pid, signal.SIGTERM)
        for server_id in self.servers:
            with contextlib.suppress(Exception):
                self.stop(server_id)

    def close(self) -> None:
        try:
            self.stop_all()
        finally:
            self.leases.close()

    def status(self, server_id: str, shard: int = 0) -> replication_pb2.ReplicaStatus | None:
        """This server's status for the queue's shard; None when it does not answer."""
        with grpc.insecure_channel(self.servers[server_id].address) as channel:
            stub = replication_pb2_grpc.ReplicationServiceStub(channel)
            try:
                answer = stub.GetReplicaStatus(
                    replication_pb2.GetReplicaStatusRequest(), metadata=self.credential.metadata, timeout=5
                )
            except grpc.RpcError:
                return None
        for replica in answer.replicas:
            if replica.queue == self.queue and replica.shard == shard:
                return replica
        return None

    def wait_until_settled(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Every shard's lease holder leads and has its whole placement in the ISR."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            settled = True
            for shard, replicas in enumerate(self.placement):
                lease = self.lease(shard)
                status = self.status(lease.holder, shard)
                if (
                    status is None
                    or status.role != replication_pb2.REPLICA_ROLE_LEADER
                    or status.epoch != lease.transitions
                    or set(status.isr) != set(replicas)
                ):
                    settled = False
                    break
            if settled:
                return
            time.sleep(STATUS_POLL_S)
        raise RuntimeError(f"the cluster did not settle within {timeout:.0f} s (see logs in {self.root})")


@contextlib.contextmanager
def running_cluster(root: pathlib.Path, **kwargs: Any) -> Iterator[Cluster]:
    cluster = Cluster(root, **kwargs)
    try:
        cluster.start_all()
        cluster.wait_until_settled()
        yield cluster
    finally:
        cluster.close()


# -- part 1: failover -------------------------------------------------------------------------


class Producer:
    """Sends 1-message unary calls on PRODUCER_LANES lanes from its own thread and event loop,
    retrying failures every PRODUCER_RETRY_S; records (start, end) of each acknowledged call."""

    def __init__(self, endpoint: str, queue: str, max_seconds: float) -> None:
        self.endpoint = endpoint
        self.queue = queue
        self.max_seconds = max_seconds
        self.acks: list[tuple[float, float]] = []
        self.errors: dict[str, int] = {}
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=40)

    def _run(self) -> None:
        event_loops.run(self._produce(), choice=event_loops.from_environment())

    async def _produce(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        channel = grpc.aio.insecure_channel(self.endpoint, options=CHANNEL_OPTIONS)
        client = AsyncClient(self.endpoint, channel=channel)
        body = Message(b"x" * 256)

        async def lane() -> None:
            while not self._stop.is_set() and time.monotonic() < deadline and self.calls < PRODUCER_MAX_CALLS:
                self.calls += 1
                began = time.monotonic()
                try:
                    results = await asyncio.wait_for(client.send_messages(self.queue, [body]), timeout=10)
                except (ShardqError, TimeoutError) as error:
                    name = type(error).__name__
                    self.errors[name] = self.errors.get(name, 0) + 1
                    await asyncio.sleep(PRODUCER_RETRY_S)
                    continue
                if all(result.ok for result in results):
                    self.acks.append((began, time.monotonic()))
                else:
                    for result in results:
                        self.errors[result.error_reason] = self.errors.get(result.error_reason, 0) + 1
                    await asyncio.sleep(PRODUCER_RETRY_S)

        try:
            await asyncio.gather(*(lane() for _ in range(PRODUCER_LANES)))
        finally:
            await client.close()

    def first_ack_started_after(self, moment: float) -> float | None:
        ends = [end for began, end in list(self.acks) if began >= moment]
        return min(ends) if ends else None

    def wait(self, predicate: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self._thread.is_alive():
                return bool(predicate())
            time.sleep(0.005)
        return False


def failover_trial(cluster: Cluster, trial: int, takeover_on: str) -> dict[str, Any]:
    lease = cluster.lease()
    victim = lease.holder
    alive = sorted(s for s in cluster.servers if s != victim)
    producer = Producer(cluster.servers[alive[trial % len(alive)]].address, cluster.queue, max_seconds=90)
    result: dict[str, Any] = {"trial": trial, "killed": victim, "epoch_before": lease.transitions}
    producer.start()
    try:
        if not producer.wait(lambda: len(producer.acks) >= WARMUP_ACKS, timeout=20):
            raise RuntimeError(f"trial {trial}: the producer got no steady acknowledgements ({producer.errors})")
        acked_before = len(producer.acks)
        killed_wall_ms = wall_ms()
        killed_at = time.monotonic()
        cluster.kill(victim)
        reaped_at = time.monotonic()
        final = cluster.lease()  # the dead leader's last renewal: nobody else writes it until the takeover
        expiry_wall_ms = final.renew_time_ms + final.duration_ms if final.holder == victim else killed_wall_ms
        # The supervisor loop.
        took_over_at: float | None = None
        seen_expired_at: float | None = None
        taken: LeaseRecord | None = None
        polls = 0
        deadline = killed_at + cluster.lease_ms / 1000 * 3 + 10
        while time.monotonic() < deadline:
            polls += 1
            current = cluster.lease()
            now = wall_ms()
            if takeover_on == "death" or is_expired(current, now):
                seen_expired_at = seen_expired_at or time.monotonic()
                candidates = sorted(isr_of(current) - {victim})
                if not candidates:
                    raise RuntimeError(f"trial {trial}: no in-sync replica to promote ({current})")
                try:
                    reason = TakeoverReason.HOLDER_DIED if takeover_on == "death" else TakeoverReason.LEASE_EXPIRED
                    takeover = build_takeover(
                        current, new_holder=candidates[0], now_ms=now, duration_ms=cluster.lease_ms
                    )
                    # As the supervisor does: the dead or silent holder leaves the ISR with the takeover.
                    isr = isr_after_takeover(Takeover(current, candidates[0], reason))
                    taken = cluster.leases.update(build_isr_change(takeover, isr))
                    took_over_at = time.monotonic()
                    break
                except LeaseConflict:
                    continue
            time.sleep(SUPERVISOR_POLL_S)
        if taken is None or took_over_at is None or seen_expired_at is None:
            raise RuntimeError(f"trial {trial}: no takeover within the deadline")
        if not producer.wait(lambda: producer.first_ack_started_after(killed_at) is not None, FIRST_ACK_TIMEOUT_S):
            raise RuntimeError(f"trial {trial}: no acknowledged send after the takeover ({producer.errors})")
        first_ack_at = producer.first_ack_started_after(killed_at)
        assert first_ack_at is not None
        # The new leader commits without the dead replica only once it has CAS-written the smaller ISR.
        result["isr_at_first_ack"] = sorted(isr_of(cluster.lease()))
        # The lease record says when it expired (renew + duration, wall clock); map onto the
        # monotonic timeline through the kill instant.
        expired_at = killed_at + (expiry_wall_ms - killed_wall_ms) / 1000
        if takeover_on == "death":
            expired_at = reaped_at  # not waited for; the "expiry" step is the reaping
        result.update(
            {
                "new_leader": taken.holder,
                "epoch_after": taken.transitions,
                "kill_to_first_ack_ms": round((first_ack_at - killed_at) * 1000, 1),
                "kill_to_lease_expiry_ms": round((expired_at - killed_at) * 1000, 1),
                "lease_expiry_to_takeover_ms": round((took_over_at - expired_at) * 1000, 1),
                "takeover_to_first_ack_ms": round((first_ack_at - took_over_at) * 1000, 1),
                "supervisor_polls": polls,
                "acks_before_kill": acked_before,
                "producer_errors": dict(producer.errors),
            }
        )
    finally:
        producer.stop()
    result["acks_total"] = len(producer.acks)
    return result


def run_failover(args: argparse.Namespace, data_root: pathlib.Path) -> dict[str, Any]:
    servers = ["s1", "s2", "s3"]
    report: dict[str, Any] = {
        "setup": {
            "servers": 3,
            "shards": 1,
            "replicas": 3,
            "lease_duration_ms": args.lease_ms,
            "supervisor_poll_ms": int(SUPERVISOR_POLL_S * 1000),
            "takeover_on": args.takeover_on,
            "producer": f"{PRODUCER_LANES} lanes of 1-message unary send_messages, retry every "
            f"{int(PRODUCER_RETRY_S * 1000)} ms, endpoint a follower (routes to the leader)",
            "first_ack": "the earliest acknowledgement of a call started after the kill",
        },
        "load_average_at_start": load_average(),
        "trials": [],
    }
    started = time.monotonic()
    with running_cluster(
        data_root / "failover",
        servers=servers,
        queue="fo",
        spec={"shards": 1, "replicas": 3},
        placement=[servers],
        lease_ms=args.lease_ms,
        peer_secret=not args.no_peer_secret,
    ) as cluster:
        for trial in range(args.trials):
            if time.monotonic() - started > args.failover_max_seconds:
                log(f"failover: stopping after {trial} trials (--failover-max-seconds)")
                report["stopped_early"] = True
                break
            result = failover_trial(cluster, trial, args.takeover_on)
            report["trials"].append(result)
            log(
                f"failover trial {trial + 1}/{args.trials}: {result['killed']} -> {result['new_leader']}: "
                f"kill->ack {result['kill_to_first_ack_ms']} ms (expiry {result['kill_to_lease_expiry_ms']}, "
                f"takeover +{result['lease_expiry_to_takeover_ms']}, first ack +{result['takeover_to_first_ack_ms']})"
            )
            # Restart the killed server; it must be back in the ISR before the next kill.
            cluster.start(result["killed"])
            rejoin_started = time.monotonic()
            try:
                cluster.wait_until_settled(timeout=ISR_REJOIN_TIMEOUT_S)
                result["restarted_back_in_isr_s"] = round(time.monotonic() - rejoin_started, 2)
            except RuntimeError:
                result["restarted_back_in_isr_s"] = None
                log(f"failover: {result['killed']} not back in the ISR within {ISR_REJOIN_TIMEOUT_S:.0f} s")
    trials = report["trials"]
    report["summary"] = {
        key: summary_ms([t[key] for t in trials])
        for key in (
            "kill_to_first_ack_ms",
            "kill_to_lease_expiry_ms",
            "lease_expiry_to_takeover_ms",
            "takeover_to_first_ack_ms",
        )
    }
    report["load_average_at_end"] = load_average()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


# -- part 2: throughput by replica count --------------------------------------------------------

SEND_PHASES = (("send.single.stream", "send_single_stream", 1), ("send.batch10.stream", "send_batch_stream", 10))
WINDOWS = {
    "send_single_stream": 64,
    "send_batch_stream": 16,
    "drain_stream": dataplane.STREAM_DELETE_WINDOW,
    "drain_unary": 1,
}


def throughput_phases(drain: str) -> tuple[tuple[str, str, int], ...]:
    """The two stream sends, then one drain of both (dataplane.py's phases and windows)."""
    return (*SEND_PHASES, (f"drain.{drain}", f"drain_{drain}", dataplane.MAX_RECEIVE_BATCH))


def run_throughput(args: argparse.Namespace, data_root: pathlib.Path) -> dict[str, Any]:
    report: dict[str, Any] = {
        "setup": {
            "replica_counts": args.replica_counts,
            "servers": "N servers for replicas=N (replicas=1 is a 1-server cluster, same lease store path)",
            "shards": args.shards,
            "placement": "every shard on [s1, ..., sN]: s1 leads all shards and is the clients' endpoint",
            "messages_per_send_phase": args.messages,
            "payload_bytes": args.payload_bytes,
            "producers": args.producers,
            "consumers": args.consumers,
            "windows": {
                "send.single.stream": 64,
                "send.batch10.stream": 16,
                "drain.stream_deletes_in_flight": WINDOWS["drain_stream"],
                "drain.unary_receive_loops": 1,
            },
            "stream_credits": dataplane.STREAM_CREDITS,
            "stream_frame_messages": dataplane.STREAM_FRAME,
            "phases": [name for name, _, _ in throughput_phases(args.drain)],
            "cpu": "server_cpu_us_per_msg is the leader's; all_servers_cpu_s sums every server over the phase",
            "note": "clients and every server share the machine's CPUs",
            "peer_secret": not args.no_peer_secret,
        },
        "load_average_at_start": load_average(),
        "runs": [],
    }
    workers: dict[str, dataplane.Worker] = {}
    try:
        workers = {"producer": dataplane.start_worker("producer"), "consumer": dataplane.start_worker("consumer")}
        for replicas in args.replica_counts:
            servers = [f"s{i + 1}" for i in range(replicas)]
            run: dict[str, Any] = {"replicas": replicas, "load_average_at_start": load_average(), "phases": []}
            log(f"throughput: replicas={replicas}")
            with running_cluster(
                data_root / f"throughput-r{replicas}",
                servers=servers,
                queue="bench",
                spec={"shards": args.shards, "replicas": replicas},
                placement=[servers] * args.shards,
                lease_ms=args.lease_ms,
                peer_secret=not args.no_peer_secret,
            ) as cluster:
                leader = cluster.servers["s1"]
                stored = 0
                for name, kind, batch in throughput_phases(args.drain):
                    is_send = kind in dataplane.SEND_KINDS
                    spec = dataplane.PhaseSpec(
                        name=name,
                        kind=kind,
                        endpoint=leader.address,
                        queue="bench",
                        server_pid=leader.pid,
                        tasks=args.producers if is_send else args.consumers,
                        messages=args.messages if is_send else stored,
                        batch_size=batch,
                        window=WINDOWS[kind],
                        max_seconds=args.max_seconds,
                        payload_bytes=args.payload_bytes,
                        seed=1,
                    )
                    pids = [s.pid for s in cluster.servers.values()]
                    cpu_before = sum(dataplane.process_cpu_seconds(pid) for pid in pids)
                    result = workers["producer" if is_send else "consumer"].run(spec)
                    result["all_servers_cpu_s"] = round(
                        sum(dataplane.process_cpu_seconds(pid) for pid in pids) - cpu_before, 3
                    )
                    stored = stored + result["messages"] if is_send else 0
                    run["phases"].append(result)
                    log(f"  r={replicas} {dataplane.progress_line(result)}")
                run["data_bytes_per_server"] = {s: directory_bytes(p.data_dir) for s, p in cluster.servers.items()}
            run["load_average_at_end"] = load_average()
            report["runs"].append(run)
    finally:
        for worker in workers.values():
            worker.stop()
    base = {p["phase"]: p["msgs_per_s"] for p in report["runs"][0]["phases"]} if report["runs"] else {}
    table: dict[str, dict[str, Any]] = {}
    for run in report["runs"]:
        for phase in run["phases"]:
            row = table.setdefault(phase["phase"], {})
            ratio = phase["msgs_per_s"] / base[phase["phase"]] if base.get(phase["phase"]) else None
            row[f"replicas={run['replicas']}"] = {
                "msgs_per_s": phase["msgs_per_s"],
                "ratio_to_first": round(ratio, 3) if ratio is not None else None,
                "hit_time_limit": phase["hit_time_limit"],
                # A drain whose messages come back (visibility timeout) measures the backlog, not the server.
                "redelivered": phase.get("redelivered", 0),
            }
    report["summary"] = table
    report["load_average_at_end"] = load_average()
    return report


# -- part 3: follower bootstrap -----------------------------------------------------------------


async def fill(endpoint: str, queue: str, messages: int, max_seconds: float) -> dict[str, Any]:
    """Send `messages` 64 KiB bodies in batches of BOOTSTRAP_BATCH, BOOTSTRAP_WINDOW calls in flight."""
    body = random.Random(7).randbytes(BOOTSTRAP_BODY_BYTES)
    channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
    client = AsyncClient(endpoint, channel=channel)
    started = time.monotonic()
    deadline = started + max_seconds
    remaining = messages
    stored = 0
    failed = 0
    next_report = 0.0

    async def lane() -> None:
        nonlocal remaining, stored, failed, next_report
        while remaining > 0 and time.monotonic() < deadline:
            count = min(BOOTSTRAP_BATCH, remaining)
            remaining -= count
            try:
                results = await client.send_messages(queue, [Message(body)] * count)
            except ShardqError:
                failed += count
                await asyncio.sleep(0.1)
                continue
            ok = sum(1 for r in results if r.ok)
            stored += ok
            failed += count - ok
            if stored / messages >= next_report:
                elapsed = time.monotonic() - started
                rate = stored * BOOTSTRAP_BODY_BYTES / elapsed / 2**20 if elapsed else 0.0
                log(f"  fill: {stored}/{messages} messages ({stored / messages:.0%}), {rate:.1f} MiB/s")
                next_report += 0.1

    try:
        await asyncio.gather(*(lane() for _ in range(BOOTSTRAP_WINDOW)))
    finally:
        await client.close()
    elapsed = time.monotonic() - started
    return {
        "messages": stored,
        "failed": failed,
        "body_bytes": BOOTSTRAP_BODY_BYTES,
        "gib": round(stored * BOOTSTRAP_BODY_BYTES / 2**30, 3),
        "elapsed_s": round(elapsed, 1),
        "mib_per_s": round(stored * BOOTSTRAP_BODY_BYTES / elapsed / 2**20, 1) if elapsed else 0.0,
        "hit_time_limit": stored + failed < messages,
    }


def bootstrap_once(args: argparse.Namespace, data_root: pathlib.Path, variant: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"shards": 1, "replicas": 2}
    if variant == "snapshot":
        spec["journal_retention"] = "1s"
    servers = ["s1", "s2"]
    messages = max(1, int(args.bootstrap_gib * 2**30 / BOOTSTRAP_BODY_BYTES))
    report: dict[str, Any] = {"variant": variant, "queue_spec": spec, "load_average_at_start": load_average()}
    log(f"bootstrap ({variant}): filling {messages} x 64 KiB = {args.bootstrap_gib} GiB")
    with running_cluster(
        data_root / f"bootstrap-{variant}",
        servers=servers,
        queue="boot",
        spec=spec,
        placement=[servers],
        lease_ms=args.lease_ms,
        peer_secret=not args.no_peer_secret,
    ) as cluster:
        leader, follower = cluster.servers["s1"], cluster.servers["s2"]
        report["fill"] = event_loops.run(
            fill(leader.address, "boot", messages, args.bootstrap_max_seconds), choice=event_loops.from_environment()
        )
        leader_status = cluster.status("s1")
        follower_status = cluster.status("s2")
        assert leader_status is not None
        assert follower_status is not None
        report["after_fill"] = {
            "leader_last_index": leader_status.last_index,
            "follower_last_index": follower_status.last_index,
            "leader_data_bytes": directory_bytes(leader.data_dir),
            "follower_data_bytes": directory_bytes(follower.data_dir),
        }
        log(f"  stopping {follower.server_id} and deleting {follower.data_dir}")
        report["follower_exit_code"] = cluster.stop("s2")
        shutil.rmtree(follower.data_dir)
        if variant == "snapshot":
            time.sleep(PRUNE_WAIT_S)  # the leader prunes log entries older than 1 s once a second
        restart_at = time.monotonic()
        cluster.start("s2")
        listening_s = time.monotonic() - restart_at
        roles_seen: set[str] = set()
        isr_sets: list[dict[str, Any]] = []
        in_isr_while_behind: list[dict[str, Any]] = []
        caught_up_s: float | None = None
        isr_rejoined_s: float | None = None
        last_report = 0.0
        samples = 0
        deadline = restart_at + args.bootstrap_max_seconds
        target = 0
        while time.monotonic() < deadline:
            samples += 1
            mine = cluster.status("s2")
            theirs = cluster.status("s1")
            elapsed = time.monotonic() - restart_at
            if mine is not None:
                roles_seen.add(ROLE_NAMES.get(mine.role, str(mine.role)))
            if mine is not None and theirs is not None:
                target = theirs.last_index
                isr = sorted(theirs.isr)
                lease_isr = sorted(isr_of(cluster.lease()))
                if not isr_sets or (isr_sets[-1]["leader_isr"], isr_sets[-1]["lease_isr"]) != (isr, lease_isr):
                    isr_sets.append({"at_s": round(elapsed, 2), "leader_isr": isr, "lease_isr": lease_isr})
                behind = mine.last_index < theirs.last_index or mine.applied_index < theirs.last_index
                if behind and "s2" in lease_isr:
                    in_isr_while_behind.append(
                        {
                            "at_s": round(elapsed, 2),
                            "role": ROLE_NAMES.get(mine.role, str(mine.role)),
                            "follower_last_index": mine.last_index,
                            "follower_applied_index": mine.applied_index,
                            "leader_last_index": theirs.last_index,
                        }
                    )
                if not behind:
                    caught_up_s = caught_up_s or elapsed
                    if "s2" in theirs.isr and "s2" in lease_isr:
                        isr_rejoined_s = isr_rejoined_s or elapsed
                if elapsed - last_report >= 5:
                    last_report = elapsed
                    log(
                        f"  catch-up {elapsed:.0f} s: follower {ROLE_NAMES.get(mine.role, mine.role)} last "
                        f"{mine.last_index} applied {mine.applied_index} / leader last {theirs.last_index}"
                    )
            if caught_up_s is not None and isr_rejoined_s is not None:
                break
            time.sleep(STATUS_POLL_S)
        follower_log = follower.log_path.read_text(errors="replace")
        snapshot_lines = [line for line in follower_log.splitlines() if "snapshot" in line.lower()]
        report["catch_up"] = {
            "leader_last_index": target,
            "restart_to_listening_s": round(listening_s, 2),
            "restart_to_caught_up_s": round(caught_up_s, 2) if caught_up_s is not None else None,
            "restart_to_back_in_isr_after_caught_up_s": round(isr_rejoined_s, 2)
            if isr_rejoined_s is not None
            else None,
            "payload_mib_per_s": round(report["fill"]["messages"] * BOOTSTRAP_BODY_BYTES / 2**20 / caught_up_s, 1)
            if caught_up_s
            else None,
            "leader_data_dir_mib_per_s": round(report["after_fill"]["leader_data_bytes"] / 2**20 / caught_up_s, 1)
            if caught_up_s
            else None,
            "follower_roles_seen": sorted(roles_seen),
            "leader_isr_changes": isr_sets,
            # Polls where the lease's ISR annotation named the emptied follower although it lacked entries
            # the leader had committed: a promotion then would lose them.
            "polls_in_isr_while_behind": len(in_isr_while_behind),
            "in_isr_while_behind_first_last": in_isr_while_behind[:1] + in_isr_while_behind[-1:],
            "path": "snapshot" if any("bootstrapped from" in line for line in snapshot_lines) else "log shipping",
            "follower_snapshot_log_lines": snapshot_lines[-5:],
            "follower_data_bytes": directory_bytes(follower.data_dir),
            "status_polls": samples,
        }
        log(f"  bootstrap ({variant}): {report['catch_up']}")
    report["load_average_at_end"] = load_average()
    shutil.rmtree(data_root / f"bootstrap-{variant}", ignore_errors=True)
    return report


def run_bootstrap(args: argparse.Namespace, data_root: pathlib.Path) -> dict[str, Any]:
    free = shutil.disk_usage(data_root).free
    needed = int(args.bootstrap_gib * 2**30 * 5)  # leader + follower + snapshot copies + slack
    if free < needed:
        raise RuntimeError(f"{free / 2**30:.1f} GiB free under {data_root}; need about {needed / 2**30:.1f} GiB")
    return {
        "free_disk_gib_at_start": round(free / 2**30, 1),
        "runs": [bootstrap_once(args, data_root, variant) for variant in args.bootstrap_variants],
    }


# -- main ------------------------------------------------------------------------------------------

PARTS = ("failover", "throughput", "bootstrap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help=f"which parts to run: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--lease-ms", type=int, default=2_000, help="lease duration in the cluster file")
    parser.add_argument("--trials", type=int, default=20, help="failover trials")
    parser.add_argument("--takeover-on", choices=("expiry", "death"), default="expiry")
    parser.add_argument("--failover-max-seconds", type=float, default=300.0, help="no new trial after this")
    parser.add_argument("--messages", type=int, default=20_000, help="messages per send phase (throughput)")
    parser.add_argument("--replica-counts", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 3])
    parser.add_argument("--shards", type=int, default=4, help="shards of the throughput queue")
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time limit per throughput phase")
    parser.add_argument("--drain", choices=("stream", "unary"), default="stream", help="the throughput drain phase")
    parser.add_argument("--bootstrap-gib", type=float, default=1.0)
    parser.add_argument(
        "--bootstrap-variants",
        type=lambda t: t.split(","),
        default=["log", "snapshot"],
        help="log (default journal retention), snapshot (journal_retention=1s)",
    )
    parser.add_argument("--bootstrap-max-seconds", type=float, default=900.0, help="limit for the fill and catch-up")
    parser.add_argument("--label", default="default", help="names the output file replication-LABEL.json")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory to write replication-LABEL.json")
    parser.add_argument("--data-root", type=pathlib.Path, default=None, help="where the temp data dir goes")
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument(
        "--no-peer-secret", action="store_true", help="servers without a peer secret (every caller is a peer)"
    )
    args = parser.parse_args(argv)
    args.parts = args.parts or list(PARTS)
    if any(part not in PARTS for part in args.parts):
        parser.error(f"parts are {', '.join(PARTS)}")
    if args.trials < 1 or args.messages < 1 or args.lease_ms < 100 or args.bootstrap_gib <= 0:
        parser.error("--trials, --messages, --bootstrap-gib must be positive and --lease-ms >= 100")
    if any(v not in ("log", "snapshot") for v in args.bootstrap_variants):
        parser.error("--bootstrap-variants takes log and/or snapshot")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.label):
        parser.error("--label may only hold letters, digits, '.', '_' and '-'")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_root = pathlib.Path(tempfile.mkdtemp(prefix="shardq-repl-bench-", dir=args.data_root))
    report: dict[str, Any] = {
        "benchmark": "shardq-replication",
        "label": args.label,
        "command": " ".join(["python", "bench/replication.py", *(argv if argv is not None else sys.argv[1:])]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": dataplane.environment(data_root),
    }
    runners = {"failover": run_failover, "throughput": run_throughput, "bootstrap": run_bootstrap}
    try:
        for part in args.parts:
            log(f"== {part} (data under {data_root})")
            try:
                report[part] = runners[part](args, data_root)
            except Exception as error:  # keep the other parts' figures
                log(f"{part} failed: {error!r}")
                report[part] = {"error": repr(error)}
    finally:
        report["environment"]["load_average_at_end"] = load_average()
        if args.keep_data:
            log(f"kept {data_root}")
        else:
            shutil.rmtree(data_root, ignore_errors=True)
    reports.emit(report, args.out, f"replication-{args.label}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
