"""The data-plane process: shard state machine, LMDB storage, gRPC service and metrics.

May import `shardq` (shared types, errors); never imports the operator.
"""
