"""Free loopback ports for servers that tests and benchmarks start.

A probed port is free only at the moment of the probe; callers that restart a server
on the same port accept that another process may take it meanwhile.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"


# Below the kernel's ephemeral range (32768 and up here), where outgoing connections and
# other programs' port-0 listeners take theirs, and below free_port_block's range.
FREE_PORTS = range(10_000, 20_000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free at the moment of the probe, never handed out twice in this
    process: a port the kernel hands out for port 0 is released at once, and the next
    call (a cluster's second server) or another program could be handed it again; one
    test lost a server that way to a listener that took its port first."""
    rng = random.Random()
    for _ in range(1_000):
        port = rng.choice(FREE_PORTS)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    raise AssertionError(f"no free port in {FREE_PORTS}")


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
