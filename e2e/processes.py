"""Processes of the real node's pods, seen from the host (the node is this machine)."""

from __future__ import annotations

import pathlib


def server_pid(namespace: str, server: str) -> int:
    """The `shardq serve` process of pod `server` in `namespace`, found through /proc: the
    server itself, not the image's init (tini) whose command line holds the same words. A
    signal for tini is not the server's: SIGSTOP would pause nothing."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tini" in arguments[0]:
            continue
        if b"serve" in arguments and server.encode() in arguments and namespace.encode() in arguments:
            return int(entry.name)
    raise AssertionError(f"no server process for {server} in {namespace}")


def container_process(pod: str, argument: str) -> int:
    """The process of pod `pod` (its container's HOSTNAME) whose command line has `argument`:
    for pods whose command lines are alike (an operator Deployment's replicas)."""
    hostname = f"HOSTNAME={pod}".encode()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tini" in arguments[0]:
            continue
        if argument.encode() in arguments and hostname in environment:
            return int(entry.name)
    raise AssertionError(f"no process with {argument!r} in pod {pod}")
