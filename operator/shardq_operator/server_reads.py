"""What the shard servers say, read on a thread of its own so the reconcile never waits on them.

The reconcile decides failovers. Its reason to exist is a server that stopped answering,
so it must not ask servers anything itself: a paused server accepts connections and never
replies, and a pass that reads a queue's counts from it (30 s client deadline, 10 s per
forwarded shard) held every failover of the cluster back by minutes. The reconcile says
which servers and queues it wants read (`want`) and takes the latest figures
(`leader_reports`, `queue_counts`); this thread reads them every `every_s`. Figures are
status only (load for rebalancing, depth and counts for `kubectl get`), so slightly old
ones are fine and missing ones mean "not known yet".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardq import Client, ShardqError
from shardq.coordination.peer_credentials import NO_PEER_SECRET, PeerCredential
from shardq.coordination.placement import ShardId
from shardq.durations import format_age_ms
from shardq.tls import ClientTls
from shardq_operator.statuses import LeaderReport, TlsByAddress, leader_reports
from shardq_operator.transport_security import CallTls

log = logging.getLogger(__name__)

ClusterKey = tuple[str, str]  # (namespace, cluster)


@dataclasses.dataclass(frozen=True, slots=True)
class Wanted:
    """What to read for one cluster: from which ready servers, and which queues' counts."""

    addresses: tuple[str, ...]
    queues: tuple[str, ...]
    # What the servers' status calls carry (the cluster's peer secret).
    credential: PeerCredential = NO_PEER_SECRET
    # How they speak TLS, by address (an address not in it serves plaintext).
    tls: TlsByAddress = dataclasses.field(default_factory=dict)


def client_tls_of(call: CallTls) -> ClientTls:
    """The client settings of the operator's TLS calls to one server (transport_security)."""
    return ClientTls(root_certificates=call.ca_certificates, server_name=call.server_name)


def read_queue_counts(
    addresses: Sequence[str], queue: str, credential: PeerCredential = NO_PEER_SECRET, tls: TlsByAddress | None = None
) -> dict[str, Any] | None:
    """visible / inFlight / oldestAge of `queue` from the first server that answers
    (it gathers the other shards' from their leaders), or None when none does or some
    shard's leader did not answer: the status keeps its last whole figures rather than
    show a count that leaves out a shard's messages. The calls carry `credential`, the
    cluster's peer secret, which servers that authenticate clients take in place of a token,
    and speak TLS to the servers `tls` has settings for."""
    for address in addresses:
        try:
            with Client(
                address, route_directly=False, metadata=credential.metadata, tls=(tls or {}).get(address, False)
            ) as shardq_client:
                attributes = shardq_client.attributes(queue)
        except ShardqError:
            continue
        if not attributes.complete:
            continue  # another server may reach the leader this one could not
        return {
            "visible": attributes.visible,
            "inFlight": attributes.in_flight,
            "oldestAge": format_age_ms(attributes.oldest_age_ms) if attributes.oldest_age_ms else "",
        }
    return None


class ServerReads:
    def __init__(
        self,
        *,
        every_s: float,
        read_reports: Callable[[Sequence[str], PeerCredential, TlsByAddress], dict[ShardId, LeaderReport]] = (
            leader_reports
        ),
        read_counts: Callable[
            [Sequence[str], str, PeerCredential, TlsByAddress], dict[str, Any] | None
        ] = read_queue_counts,
        background: bool = True,
    ) -> None:
        """`background=False` reads only when `read_once` is called (tests drive the rounds)."""
        self.every_s = every_s
        self.background = background
        self._read_reports = read_reports
        self._read_counts = read_counts
        self._lock = threading.Lock()
        self._wanted: dict[ClusterKey, Wanted] = {}
        self._reports: dict[ClusterKey, dict[ShardId, LeaderReport]] = {}
        self._counts: dict[tuple[str, str], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._woken = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the reconcile's side: never blocks on a server -----------------------------------
    def want(
        self,
        cluster: ClusterKey,
        *,
        addresses: Sequence[str],
        queues: Sequence[str],
        credential: PeerCredential = NO_PEER_SECRET,
        tls: TlsByAddress | None = None,
    ) -> None:
        """Read these from now on (the reconcile calls it every pass with what it sees).
        The first call for a cluster wakes the reader, so a new cluster's figures come at once."""
        wanted = Wanted(tuple(addresses), tuple(queues), credential, dict(tls or {}))
        with self._lock:
            first = cluster not in self._wanted
            self._wanted[cluster] = wanted
            self._drop_unwanted_counts()
            if self._thread is None and self.background:
                self._thread = threading.Thread(target=self._run, name="server-reads", daemon=True)
                self._thread.start()
        if first:
            self._woken.set()

    def forget(self, cluster: ClusterKey) -> None:
        with self._lock:
            self._wanted.pop(cluster, None)
            self._reports.pop(cluster, None)
            self._drop_unwanted_counts()

    def _drop_unwanted_counts(self) -> None:
        """Counts of queues no cluster wants any more (deleted Queues) go (lock held)."""
        for key in [key for key in self._counts if not self._wanted_queue(*key)]:
            del self._counts[key]

    def _wanted_queue(self, namespace: str, queue: str) -> bool:
        """Whether a cluster in `namespace` still wants `queue`'s counts (lock held)."""
        return any(cluster[0] == namespace and queue in what.queues for cluster, what in self._wanted.items())

    def leader_reports(self, cluster: ClusterKey) -> dict[ShardId, LeaderReport]:
        with self._lock:
            return dict(self._reports.get(cluster, {}))

    def queue_counts(self, namespace: str, queue: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._counts.get((namespace, queue), {}))

    def stop(self) -> None:
        self._stop.set()
        self._woken.set()

    # -- the reader's side -------------------------------------------------------------
    def read_once(self) -> None:
        """One round over every wanted cluster (the thread's body; tests call it directly)."""
        with self._lock:
            wanted: Mapping[ClusterKey, Wanted] = dict(self._wanted)
        for cluster, what in wanted.items():
            reports = self._read_reports(what.addresses, what.credential, what.tls)
            with self._lock:
                if cluster in self._wanted:
                    self._reports[cluster] = reports
            for queue in what.queues:
                counts = self._read_counts(what.addresses, queue, what.credential, what.tls)
                if counts is None:
                    continue  # nobody answered: keep the last figures
                with self._lock:
                    # Not for a queue deleted while it was being read: its figures would stay.
                    if self._wanted_queue(cluster[0], queue):
                        self._counts[(cluster[0], queue)] = counts

    def _run(self) -> None:
        while not self._stop.is_set():
            self._woken.clear()
            try:
                self.read_once()
            except Exception:  # a status figure is not worth the thread
                log.warning("reading the servers' reports failed", exc_info=True)
            self._woken.wait(self.every_s)
