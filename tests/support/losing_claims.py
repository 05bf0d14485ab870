"""`python tests/support/losing_claims.py serve ...`: `shardq serve` that loses chosen claims.

A fault injector, used where the real fault cannot be arranged on cue. A claim is lost
for real when its shard's leadership moves before the claim replicates: the receive
then fails with OUTCOME_UNKNOWN, and what the claim took stays invisible until its
visibility timeout. When that happens depends on lease timing, so no test can make it
happen at a chosen receive. This launcher does: it wraps `HostedQueue.receive` in the
server's own process, everything else being the real server.

SHARDQ_TEST_LOSE_CLAIMS picks the receives, numbered from 1 in the order the server
starts them, e.g. "2:lost,3:not-leader":

  lost        the claim is made and committed as usual, then the call fails with
              OUTCOME_UNKNOWN, as a lost claim does; the bodies of the messages it
              took are appended, one per line, to the file SHARDQ_TEST_LOST_BODIES
  not-leader  the call fails with NOT_LEADER before it claims anything, as on a
              server whose leadership just moved
"""

from __future__ import annotations

import itertools
import os
import pathlib
from typing import Any

LOSE_CLAIMS = "SHARDQ_TEST_LOSE_CLAIMS"
LOST_BODIES = "SHARDQ_TEST_LOST_BODIES"


def _chosen() -> dict[int, str]:
    chosen = {}
    for item in os.environ.get(LOSE_CLAIMS, "").split(","):
        if item.strip():
            number, fault = item.split(":")
            if fault not in ("lost", "not-leader"):
                raise SystemExit(f"{LOSE_CLAIMS}: unknown fault {fault!r} (lost, not-leader)")
            chosen[int(number)] = fault
    return chosen


def lose_chosen_claims() -> None:
    from shard_server.runtime.hosting import HostedQueue, Received
    from shardq.errors import NotLeader, OutcomeUnknown

    chosen = _chosen()
    lost_bodies = pathlib.Path(os.environ.get(LOST_BODIES, os.devnull))
    numbers = itertools.count(1)
    receive = HostedQueue.receive

    async def receive_losing_chosen_claims(self: HostedQueue, **arguments: Any) -> Received:
        fault = chosen.get(next(numbers))
        if fault == "not-leader":
            raise NotLeader(f"{self.config.name}: fault injected: leadership moved before this receive claimed")
        received = await receive(self, **arguments)
        if fault == "lost":
            with lost_bodies.open("a") as out:
                out.writelines(message.record.body.decode() + "\n" for _, message in received.local)
            raise OutcomeUnknown(f"{self.config.name}: fault injected: the claim was lost before it replicated")
        return received

    HostedQueue.receive = receive_losing_chosen_claims  # type: ignore[method-assign]


if __name__ == "__main__":
    from shardq.grpc_io import use_completion_queue_polling

    use_completion_queue_polling()  # before the wrapping imports gRPC, as the shardq command does
    lose_chosen_claims()
    from shardq.__main__ import main

    main()
