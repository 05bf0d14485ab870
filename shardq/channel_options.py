"""gRPC channel options every shardq channel shares: the client's, the servers' to their
peers, and the Spark source's."""

from __future__ import annotations

# A restarted pod comes back at a new address under the same DNS name. gRPC's core
# re-resolves a name at most every 30 s by default, so a channel kept dialling the old
# address for up to 30 s after each restart (measured 25-28 s per pod of a rolling
# update on the real node: the restarted follower stayed out of its shards' ISRs that
# long). Half a second bounds how often a failing channel asks DNS again.
RESOLVE_AGAIN_WITHIN_HALF_A_SECOND = ("grpc.dns_min_time_between_resolutions_ms", 500)
