"""Replicating a shard across servers (DESIGN §5).

`rules` holds the pure decisions (the commit index over the in-sync replicas, who
belongs in the ISR); `replica` runs one replica (role from the lease, log shipping,
follower appends, snapshots) against the small `ReplicatedShard` protocol of what it
needs from a hosted shard; `peers` holds the channels to the other servers.
"""
