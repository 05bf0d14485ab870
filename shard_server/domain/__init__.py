"""The queue's pure state machine. Standard library only: no LMDB, gRPC, asyncio or
clock reads (`now_ms` is always a parameter), so every rule is testable without a server."""
