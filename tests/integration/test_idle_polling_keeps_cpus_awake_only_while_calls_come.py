"""`shardq serve --idle-poll` (shard_server/runtime/idle_polling.py): spinner processes
at SCHED_IDLE, one per CPU asked for, that burn CPU only for a moment after answers,
stay quiet when calls stop or the server is busy, and never outlive their server, not
even one killed with SIGKILL. Real processes throughout; CPU read from /proc."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from shard_server.runtime.idle_polling import SPIN_UP_TO_CALLS, IdlePolling, cpus_to_spin_on
from shardq import Client, Message
from tests.support.servers import ServerProcess, drain, wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="idle polling needs Linux scheduling policies")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # exited, waiting for whoever adopted it to reap it


def cpu_over(pids: list[int], seconds: float) -> float:
    before = sum(cpu_seconds(pid) for pid in pids)
    time.sleep(seconds)
    return sum(cpu_seconds(pid) for pid in pids) - before


def test_spinners_spin_after_an_answer_and_rest_when_the_window_passed() -> None:
    polling = IdlePolling(400, cpus_to_spin_on(1))
    polling.start()
    try:
        (spinner,) = polling.spinner_pids
        wait_for(lambda: os.sched_getscheduler(spinner) == os.SCHED_IDLE, timeout=10, what="the spinner's policy")
        assert os.sched_getaffinity(spinner) == {min(os.sched_getaffinity(0))}
        quiet = cpu_over([spinner], 0.3)
        polling.called(0)
        spinning = cpu_over([spinner], 0.3)  # inside the 400 ms window
        time.sleep(0.2)  # the window has passed
        after = cpu_over([spinner], 0.3)
        polling.called(SPIN_UP_TO_CALLS + 1)  # a busy server's answer keeps nothing awake
        busy = cpu_over([spinner], 0.3)
    finally:
        polling.close()
    assert spinning >= 0.1, f"{spinning:.2f} s of CPU in 0.3 s of its window"
    for what, used in (("before any answer", quiet), ("after the window", after), ("when busy", busy)):
        assert used <= 0.05, f"{used:.2f} s of CPU in 0.3 s {what}"
    assert gone(spinner)


def test_a_server_with_idle_polling_serves_and_takes_its_spinners_with_it(tmp_path: pathlib.Path) -> None:
    cpus = min(2, len(os.sched_getaffinity(0)))
    server = ServerProcess.in_directory(
        tmp_path, ["orders:shards=2"], "--idle-poll", "300ms", "--idle-poll-cpus", str(cpus)
    )
    server.start()
    try:
        spinners = wait_for(lambda: children(server.pid) if len(children(server.pid)) == cpus else None, timeout=10)
        wait_for(
            lambda: {os.sched_getscheduler(pid) for pid in spinners} == {os.SCHED_IDLE},
            timeout=10,
            what="every spinner at SCHED_IDLE (set once it started)",
        )
        with Client(server.endpoint) as client:
            sent = client.send_messages("orders", [Message(b"m%d" % n) for n in range(20)])
            assert all(result.ok for result in sent)
            assert cpu_over(spinners, 0.2) >= 0.05, "no spinning right after answers"
            assert sorted(message.body for message in drain(client, "orders")) == sorted(b"m%d" % n for n in range(20))
        server.kill()  # SIGKILL: no shutdown code runs
        wait_for(lambda: all(gone(pid) for pid in spinners), timeout=5, what="spinners ending with their server")
        server.start()  # spinners again, and every message still there was drained
        replacements = wait_for(lambda: children(server.pid) if len(children(server.pid)) == cpus else None, timeout=10)
        assert server.stop() == 0
        wait_for(lambda: all(gone(pid) for pid in replacements), timeout=5, what="spinners ending at shutdown")
    finally:
        server.cleanup()


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--idle-poll-cpus", "1"], "--idle-poll-cpus goes with --idle-poll"),
        (["--idle-poll", "2ms", "--idle-poll-cpus", "4096"], "idle polling CPUs must be between 1 and"),
        (["--idle-poll", "soon"], "--idle-poll:"),
        (["--idle-poll", "5s"], "--idle-poll: at most 1000ms"),
    ],
)
def test_bad_idle_polling_options_are_refused_by_name(tmp_path: pathlib.Path, arguments: list[str], said: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardq", "serve", "--data-dir", str(tmp_path / "data"), "--port", "0", *arguments],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
