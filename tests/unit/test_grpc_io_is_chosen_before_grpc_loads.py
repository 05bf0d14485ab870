"""The `shardq` command asks gRPC for socket I/O on its completion-queue thread, which
gRPC reads once, at `import grpc`: so only before that import, and never over a
GRPC_EXPERIMENTS the user set (even empty). Each case runs in a fresh interpreter,
since this one has imported gRPC long ago."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardq.grpc_io import COMPLETION_QUEUE_POLLING, ENVIRONMENT_VARIABLE

PROBE = """
import os, sys
{before}
from shardq.grpc_io import use_completion_queue_polling
changed = use_completion_queue_polling()
print(changed, repr(os.environ.get("GRPC_EXPERIMENTS")))
"""


def probe(before: str = "", **environment: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != ENVIRONMENT_VARIABLE}
    env.update(environment)
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


def test_set_before_grpc_is_imported() -> None:
    assert probe() == f"True {COMPLETION_QUEUE_POLLING!r}"


@pytest.mark.parametrize("chosen", ["", "-event_engine_client"])
def test_a_users_own_setting_is_kept(chosen: str) -> None:
    assert probe(**{ENVIRONMENT_VARIABLE: chosen}) == f"False {chosen!r}"


def test_nothing_is_changed_once_grpc_is_loaded() -> None:
    assert probe(before="import grpc") == "False None"
