"""The event-loop threads blocking Clients run on, kept for the next Client once one closes.

grpc.aio binds every event loop it serves to its process-wide poller and never lets it
go, so a loop closed after use stays in memory for good (about 250 KiB with uvloop): a
process that opened and closed a blocking Client per task grew by 25 MiB per 100 Clients.
A closed Client's loop, still running on its thread with nothing on it, is given to the
next Client instead, so a process holds as many loops as it ever had Clients open at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

from shardq import event_loops
from shardq.grpc_loop_noise import ignore_grpc_poller_noise


@dataclasses.dataclass(frozen=True)
class LoopThread:
    """An event loop running forever on a daemon thread of its own."""

    kind: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def usable(self) -> bool:
        return self.thread.is_alive() and self.loop.is_running() and not self.loop.is_closed()


class _Idle:
    """Idle loops by kind. Loops and threads do not cross a fork: a child starts with none."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.loops: dict[str, list[LoopThread]] = {}


_idle = _Idle()


def take() -> LoopThread:
    """An idle loop of the kind SHARDQ_EVENT_LOOP asks for, or a new one."""
    kind = event_loops.resolve(event_loops.from_environment())
    with _idle.lock:
        idle = _idle.loops.get(kind, [])
        while idle:
            candidate = idle.pop()
            if candidate.usable():
                return candidate
    loop = event_loops.loop_factory(kind)()
    ignore_grpc_poller_noise(loop)
    thread = threading.Thread(target=loop.run_forever, name="shardq-client", daemon=True)
    thread.start()
    return LoopThread(kind, loop, thread)


def give_back(loop_thread: LoopThread) -> None:
    """Keep a loop whose Client closed (nothing left on it) for the next Client."""
    with _idle.lock:
        if loop_thread.usable():
            _idle.loops.setdefault(loop_thread.kind, []).append(loop_thread)
