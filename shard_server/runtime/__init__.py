"""Running shards inside the server process: group commit, hosting queues, background loops.

Glue between asyncio and the pure domain; LMDB is reached only through shard_server.storage.
"""
