"""`auto` means uvloop where it is installed and asyncio's loop where it is not; a name
we do not know, or uvloop asked for by name where it is missing, is refused by name."""

from __future__ import annotations

import asyncio
import sys

import pytest

from shardq import event_loops


async def loop_module() -> str:
    return event_loops.name_of(asyncio.get_running_loop())


def test_auto_runs_on_uvloop_when_it_is_installed() -> None:
    assert event_loops.resolve("auto") == "uvloop"
    assert event_loops.run(loop_module()).startswith("uvloop")
    assert event_loops.run(loop_module(), choice="asyncio").startswith("asyncio")


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as on a machine without its wheel
    assert event_loops.resolve("auto") == "asyncio"
    assert event_loops.run(loop_module()).startswith("asyncio")
    with pytest.raises(event_loops.EventLoopUnavailable, match="uvloop is not installed"):
        event_loops.resolve("uvloop")


def test_an_unknown_loop_is_refused_by_name() -> None:
    main = loop_module()
    with pytest.raises(event_loops.EventLoopUnavailable, match="unknown event loop 'trio'"):
        event_loops.run(main, choice="trio")
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited
