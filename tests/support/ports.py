"""Free loopback ports for servers that tests and benchmarks start.

A probed port is free only at the moment of the probe; callers that restart a server
on the same port accept that another process may take it meanwhile.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port the kernel just handed out on loopback, and released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_block(count: int) -> tuple[int, int]:
    """A gRPC base port and a metrics base port with `count` free consecutive ports each
    (a local cluster numbers its servers' ports from a base)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 40_000)
        metrics = base + 10_000
        if all(port_is_free(port) for port in [*range(base, base + count), *range(metrics, metrics + count)]):
            return base, metrics
    raise AssertionError("no block of free ports found")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True
