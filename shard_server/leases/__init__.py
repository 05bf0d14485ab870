"""Who leads a shard, and in which epoch: the lease store interface and the fencing rules.

`store` and `fencing` do no I/O and read no clock (`now_ms` is a parameter), so every
fencing rule is testable without a server; the implementations are the edges: Kubernetes
Leases in `kubernetes`, one shared LMDB file in `shard_server.storage.lease_store`.
"""
