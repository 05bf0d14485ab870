"""When a starting server of a replicated cluster reports ready: once its replicas are in sync.

Kubernetes reads readiness (the gRPC health check of service "") to decide when a rolling
update may stop the next pod, and the operator promotes only replicas on ready servers. A
server that reported ready as soon as it listened let the next pod go while its own
copies were still catching up: for that time a shard had one in-sync copy fewer than its
replication factor, and a roll of three pods could leave a shard with a single one.
So the first SERVING waits until every hosted replica is in sync (it leads, or the
lease's ISR names it and it has caught up with the leader), or until `within_s` has
passed: a replica whose leader is gone for good must not keep the server out of service
forever, and the server then says which replicas are still behind. Readiness is gated
once, at start: a follower falling behind later does not take a serving pod out of its
Service.

Once ready the server prints READY_LINE to stderr: `shardq local` waits for it, as the
kubelet waits for the health check.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

POLL_S = 0.2
READY_LINE = "shardq: ready"


async def announce_ready(health_servicer: health.aio.HealthServicer) -> None:
    """Report SERVING for service "" and say so on stderr."""
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(READY_LINE, file=sys.stderr, flush=True)


async def report_ready_once_in_sync(
    health_servicer: health.aio.HealthServicer, out_of_sync: Callable[[], list[str]], *, within_s: float
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while behind := out_of_sync():
        if loop.time() - started >= within_s:
            log.warning(
                "replicas %s are still out of sync after %.0f s: reporting ready anyway", ", ".join(behind), within_s
            )
            break
        await asyncio.sleep(POLL_S)
    else:
        log.info("every replica in sync after %.1f s: reporting ready", loop.time() - started)
    await announce_ready(health_servicer)
