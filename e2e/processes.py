"""Processes of the real node's pods, seen from the host (the node is this machine)."""

from __future__ import annotations

import pathlib


def server_pid(namespace: str, server: str) -> int:
    """The `shardq serve` process of pod `server` in `namespace`, found through /proc."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in arguments and server.encode() in arguments and namespace.encode() in arguments:
            return int(entry.name)
    raise AssertionError(f"no server process for {server} in {namespace}")
