"""`./dev demo`, the README's first command, as a user runs it (shortened): a replicated
local cluster, a producer and a consumer, a leader SIGKILLed a third of the way in.
It must finish, drain, and find by message number that every acknowledged message
was handled or (the ones its handler always fails) dead-lettered."""

from __future__ import annotations

import re
import subprocess
import sys


def test_the_demo_survives_its_leader_kill_and_loses_nothing() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "shardq", "demo", "--duration", "12s", "--rate", "100"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-3000:]
    assert "*** SIGKILLed" in output, output[-3000:]
    assert "drained: every message was handled or dead-lettered" in output, output[-3000:]
    checked = re.search(r"checked: all (\d+) acknowledged messages that could be handled were handled", output)
    assert checked is not None, output[-3000:]
    done = re.search(r"done: sent (\d+), handled \d+, dead-lettered (\d+),", output)
    assert done is not None, output[-3000:]
    sent, dead, handled = int(done.group(1)), int(done.group(2)), int(checked.group(1))
    # The rest of what was acknowledged is the one number in twenty whose handler always
    # fails: every one of those must be in the DLQ (more, if a send retried during the
    # failover was stored twice: at-least-once).
    poisoned = sent - handled
    assert 0 < poisoned <= sent // 20 + 1
    assert dead >= poisoned
