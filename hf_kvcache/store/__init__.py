"""Prefix store: encoded KV of token prefixes in a radix tree, LRU under a byte budget, rematerialization, and
backends in memory, on disk and in Redis (`PrefixStore`, `MemoryBackend`, `DiskBackend`, `RedisBackend`)."""

from .backends import Backend, DiskBackend, MemoryBackend, RedisBackend, find_redis_server, local_redis_server
from .prefix_store import CostModel, Hit, PrefixStore
from .radix import RadixTree

__all__ = [
    "Backend",
    "CostModel",
    "DiskBackend",
    "Hit",
    "MemoryBackend",
    "PrefixStore",
    "RadixTree",
    "RedisBackend",
    "find_redis_server",
    "local_redis_server",
]
