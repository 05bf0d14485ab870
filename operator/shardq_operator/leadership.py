"""Which operator replica acts: the holder of one Lease, as shard leaders hold theirs.

Two (or more) operator processes run; each asks `leading()` before it acts. The holder
renews every quarter lease; the others take the Lease over once it has expired (the
holder died, hung or lost the API server), by compare-and-swap, in a new epoch. A
holder stops acting by itself before its lease could have expired in another's eyes
(`fencing.safe_serving_deadline_ms`), so two replicas never act at once; and every
write they make is itself a compare-and-swap or an idempotent apply, so even a late
write from a deposed replica does no harm.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from shardq.coordination.fencing import build_renewal, build_takeover, is_expired, safe_serving_deadline_ms
from shardq.coordination.leases import LeaseConflict, LeaseRecord, LeaseStore

log = logging.getLogger(__name__)

LEASE_NAME = "shardq-operator"
DEFAULT_DURATION_MS = 5_000


def default_identity() -> str:
    """The pod's name in a pod, else host and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class OperatorLeadership:
    def __init__(
        self, store: LeaseStore, *, identity: str, duration_ms: int = DEFAULT_DURATION_MS, name: str = LEASE_NAME
    ) -> None:
        self.store = store
        self.identity = identity
        self.duration_ms = duration_ms
        self.name = name
        self._lock = threading.Lock()
        self._serving_until_ms = 0
        self._renewed_at_ms = 0
        self._was_leading = False
        self._stop_renewing = threading.Event()

    def keep_renewing(self) -> threading.Thread:
        """Renew (or try to take) the Lease every quarter lease on a thread of its own.

        Renewing only when a handler asks would tie the Lease to the reconcile loop: one
        pass slower than the lease (a loaded node, a slow API server) and the standby takes
        over, then this replica takes it back at its next pass; leadership flapped between
        the replicas that way while pods rolled. The thread stops with `stop_renewing`."""
        thread = threading.Thread(target=self._renew_loop, name="operator-lease", daemon=True)
        thread.start()
        return thread

    def stop_renewing(self) -> None:
        self._stop_renewing.set()

    def _renew_loop(self) -> None:
        while not self._stop_renewing.wait(self.duration_ms / 4 / 1000):
            self.leading()

    def leading(self) -> bool:
        """Whether this replica may act now (acquiring or renewing the Lease as needed)."""
        with self._lock:
            now = _monotonic_ms()
            if now < self._serving_until_ms and now - self._renewed_at_ms < self.duration_ms // 4:
                return True
            started = now
            try:
                record = self._acquire_or_renew()
            except LeaseConflict:
                record = None
            except Exception:  # the API server is unreachable: act only while the old lease protects us
                log.warning("operator leadership: cannot reach the lease", exc_info=True)
                record = None
            if record is not None and record.holder == self.identity:
                self._renewed_at_ms = started
                self._serving_until_ms = safe_serving_deadline_ms(
                    started, duration_ms=record.duration_ms, clock_skew_margin_ms=record.duration_ms // 4
                )
            leading = _monotonic_ms() < self._serving_until_ms
            if leading != self._was_leading:
                log.info("operator %s %s", self.identity, "now leads: acting" if leading else "is standing by")
                self._was_leading = leading
            return leading

    def _acquire_or_renew(self) -> LeaseRecord | None:
        current = self.store.get(self.name)
        now = _wall_ms()
        if current is None:
            fresh = LeaseRecord(name=self.name)
            taken = build_takeover(fresh, new_holder=self.identity, now_ms=now, duration_ms=self.duration_ms)
            return self.store.create(taken)
        if current.holder == self.identity:
            return self.store.update(build_renewal(current, now_ms=now))
        if is_expired(current, now):
            return self.store.update(
                build_takeover(current, new_holder=self.identity, now_ms=now, duration_ms=self.duration_ms)
            )
        return None
