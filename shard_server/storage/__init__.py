"""Shard storage: the only package that imports lmdb. Every key layout lives in keys.py."""
