"""Who leads which shard, and where replicas live: decisions and records shared by the
local supervisor (`shardq local`) and the operator.

The pure core does no I/O and reads no clock (`now_ms` is a parameter):
`placement` (where replicas go, failover and leadership moves), `leases` (the lease
record and store interface), `fencing` (expiry, takeover, ISR rules), `takeovers`
(which lease to take from whom, and when), `cluster_map` (the one cluster map and
lease naming). Beside it, one module per store that does I/O: `kubernetes_leases`
(coordination.k8s.io Leases, watched) and `local_leases` (one shared directory, written
without a lock).
"""
