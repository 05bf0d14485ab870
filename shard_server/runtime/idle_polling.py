"""Idle polling: for a moment after each call, this machine's CPUs do not go idle.

On a virtual machine whose CPUs halt when idle (a Firecracker guest with halt
polling off, as the benchmark machine is), waking a halted CPU goes through the
hypervisor. One call with nothing else in flight wakes CPUs several times: the
request's arrival, gRPC's threads handing it to the event loop, the commit, the
answer. Measured here, a bare gRPC call on gRPC's default I/O took 0.36-0.40 ms
with every CPU kept busy by an idle-priority loop and 0.77-0.86 ms without; on the
completion-queue I/O shardq's servers use, 0.33-0.35 against 0.44-0.46 ms. With
shardq's calls the p50 gain ran from nothing to a quarter, and p99 mostly got worse:
a thread woken where a spinner runs sometimes waits for it (bench/LATENCY.md).

With idle polling on, the server starts one spinner process per CPU it may run
on. A spinner runs at SCHED_IDLE, the lowest priority Linux has: any other
thread that becomes runnable on its CPU takes the CPU at once, so it only fills
time that would otherwise be idle. It spins while the deadline the server
wrote (shared memory, one CLOCK_MONOTONIC nanosecond count) is in the future,
and naps otherwise; each answered call or stream frame moves the deadline
`window` ahead. So a server with calls arriving keeps its CPUs awake, and one
left alone goes quiet `window` after its last call. With more than a few calls in
progress answers leave the deadline alone: the CPUs are busy anyway.

The price is CPU: while calls keep coming, every spinner's CPU shows as busy,
and a container's CPU limit counts it (there, spinners eat the quota the
server needs: use fewer spinners than the limit, or none). Off by default.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

_DEADLINE = struct.Struct("=q")
# How long a spinner sleeps between looks at the deadline once it passed: the first
# call after a quiet spell pays the wake-ups anyway, so a nap only bounds how late
# spinning starts after it. Short right after the last call (calls often come back
# soon), long once the server has been quiet a while, so an idle server's spinners
# wake 50 times a second, not 2,000.
NAP_S = 0.0005
QUIET_NAP_S = 0.02
QUIET_AFTER_NS = 1_000_000_000
# With more calls than this in progress the CPUs do not go idle anyway, and spinners
# only take turns with the server's threads (measured: 9-47% slower at 64 in flight):
# answers then leave the deadline where it is.
SPIN_UP_TO_CALLS = 4


# A spinner notices its server is gone only between spins: a longer window would let it
# outlive a killed server by that long, and calls further apart gain nothing from it.
MAX_WINDOW_MS = 1000


def check_window(window_ms: float) -> None:
    """Refuse a window idle polling cannot use (the server's option says so at start)."""
    if window_ms <= 0:
        raise ValueError(f"the window must be above 0, got {window_ms}ms")
    if window_ms > MAX_WINDOW_MS:
        raise ValueError(f"at most {MAX_WINDOW_MS}ms (calls further apart gain nothing), got {window_ms}ms")


class IdlePolling:
    """The spinners of one server and the deadline they spin to (event loop only)."""

    def __init__(self, window_ms: float, cpus: Sequence[int]) -> None:
        check_window(window_ms)
        if not cpus:
            raise ValueError("idle polling needs at least one CPU to spin on")
        self._window_ns = int(window_ms * 1_000_000)
        self._fd = os.memfd_create("shardq-idle-polling", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _DEADLINE.size)
        self._shared = mmap.mmap(self._fd, _DEADLINE.size)
        self._cpus = list(cpus)
        self._spinners: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        """Start the spinners (once the server serves: a start that fails leaves none behind)."""
        self._spinners = [
            subprocess.Popen(
                [sys.executable, "-m", "shard_server.runtime.idle_polling", str(self._fd), str(cpu), str(os.getpid())],
                pass_fds=(self._fd,),
                stdin=subprocess.DEVNULL,
            )
            for cpu in self._cpus
        ]

    def called(self, calls_in_progress: int) -> None:
        """A call or frame was answered: keep the CPUs awake for the next one, unless the
        server is busy enough to keep them awake itself."""
        if calls_in_progress <= SPIN_UP_TO_CALLS:
            _DEADLINE.pack_into(self._shared, 0, time.monotonic_ns() + self._window_ns)

    @property
    def cpus(self) -> list[int]:
        return list(self._cpus)

    @property
    def spinner_pids(self) -> list[int]:
        return [spinner.pid for spinner in self._spinners]

    def close(self) -> None:
        for spinner in self._spinners:
            spinner.kill()
        for spinner in self._spinners:
            spinner.wait()
        self._spinners = []
        self._shared.close()
        os.close(self._fd)


def cpus_to_spin_on(count: int | None) -> list[int]:
    """The first `count` CPUs this process may run on (None: all of them)."""
    if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "memfd_create"):
        raise ValueError("idle polling needs Linux (SCHED_IDLE and memfd_create)")
    allowed = sorted(os.sched_getaffinity(0))
    if count is None:
        return allowed
    if count < 1 or count > len(allowed):
        raise ValueError(f"idle polling CPUs must be between 1 and {len(allowed)} (the CPUs this server may use)")
    return allowed[:count]


def spin(fd: int, cpu: int, parent: int) -> None:
    """A spinner's whole life: spin to the deadline, nap when it passed, end with the server."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    shared = mmap.mmap(fd, _DEADLINE.size, access=mmap.ACCESS_READ)
    read = _DEADLINE.unpack_from
    now = time.monotonic_ns
    while True:
        deadline = read(shared, 0)[0]
        if now() < deadline:
            continue
        if os.getppid() != parent:
            return  # the server is gone (even by SIGKILL): so is its spinner
        time.sleep(NAP_S if now() - deadline < QUIET_AFTER_NS else QUIET_NAP_S)


if __name__ == "__main__":  # pragma: no cover - run as a spinner process by IdlePolling
    spin(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
