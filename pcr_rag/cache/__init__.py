"""The PCR cache engine: a prefix tree of KV chunks over device / DRAM / SSD tiers with look-ahead LRU eviction,
asynchronous write-back and loads, and a persistent, verified SSD store. Knows nothing about transformers."""

from pcr_rag.cache.clock import Clock, ManualClock, MonotonicClock
from pcr_rag.cache.config import POLICIES, CacheConfig, RemoteConfig
from pcr_rag.cache.engine import CacheEngine, Lease, MatchResult
from pcr_rag.cache.errors import (
    CacheClosedError,
    CacheDirLockedError,
    CacheError,
    ChunkNotFoundError,
    CorruptChunkError,
)
from pcr_rag.cache.keys import KEY_BYTES, ChunkSpec, chunk_key, namespace_key, plan_chunks, tokens_digest
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.policy import LookaheadLRUPolicy, LRUPolicy
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.storage import (
    CountingBackend,
    FaultyBackend,
    LocalDirBackend,
    MemoryBackend,
    SlowBackend,
    StorageBackend,
)
from pcr_rag.cache.tiers import Tier

__all__ = [
    "KEY_BYTES",
    "POLICIES",
    "CacheClosedError",
    "CacheConfig",
    "CacheDirLockedError",
    "CacheEngine",
    "CacheError",
    "CacheStats",
    "ChunkNotFoundError",
    "ChunkSpec",
    "Clock",
    "CountingBackend",
    "CorruptChunkError",
    "FaultyBackend",
    "LRUPolicy",
    "Lease",
    "LocalDirBackend",
    "LookaheadLRUPolicy",
    "ManualClock",
    "MatchResult",
    "MemoryBackend",
    "MonotonicClock",
    "Payload",
    "SlowBackend",
    "RemoteConfig",
    "StorageBackend",
    "Tier",
    "VirtualPayload",
    "chunk_key",
    "namespace_key",
    "plan_chunks",
    "tokens_digest",
]
