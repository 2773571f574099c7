"""The PCR cache engine: a prefix tree of KV chunks over device / DRAM / SSD tiers with look-ahead LRU eviction,
asynchronous write-back and loads, and a persistent, verified SSD store. Knows nothing about transformers.

Names are imported lazily (as in `pcr_rag`), so `pcr_rag.cache.keys` and the other light modules load without
torch: the thin HTTP client and the integrations' ``base_url=`` mode import them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "KEY_BYTES": "pcr_rag.cache.keys",
    "POLICIES": "pcr_rag.cache.config",
    "CacheClosedError": "pcr_rag.cache.errors",
    "CacheConfig": "pcr_rag.cache.config",
    "CacheDirLockedError": "pcr_rag.cache.errors",
    "CacheManager": "pcr_rag.cache.manager",
    "CacheError": "pcr_rag.cache.errors",
    "CacheStats": "pcr_rag.cache.stats",
    "ChunkNotFoundError": "pcr_rag.cache.errors",
    "ChunkSpec": "pcr_rag.cache.keys",
    "Clock": "pcr_rag.cache.clock",
    "CountingBackend": "pcr_rag.cache.storage",
    "CorruptChunkError": "pcr_rag.cache.errors",
    "FaultyBackend": "pcr_rag.cache.storage",
    "LRUPolicy": "pcr_rag.cache.policy",
    "Lease": "pcr_rag.cache.manager",
    "LocalDirBackend": "pcr_rag.cache.storage",
    "LookaheadLRUPolicy": "pcr_rag.cache.policy",
    "ManualClock": "pcr_rag.cache.clock",
    "MatchResult": "pcr_rag.cache.manager",
    "MemoryBackend": "pcr_rag.cache.storage",
    "MonotonicClock": "pcr_rag.cache.clock",
    "Payload": "pcr_rag.cache.payload",
    "SlowBackend": "pcr_rag.cache.storage",
    "RemoteConfig": "pcr_rag.cache.config",
    "StorageBackend": "pcr_rag.cache.storage",
    "Tier": "pcr_rag.cache.tiers",
    "VirtualPayload": "pcr_rag.cache.payload",
    "blend_root": "pcr_rag.cache.keys",
    "chunk_key": "pcr_rag.cache.keys",
    "namespace_key": "pcr_rag.cache.keys",
    "plan_chunks": "pcr_rag.cache.keys",
    "tokens_digest": "pcr_rag.cache.keys",
}

__all__ = [
    "KEY_BYTES",
    "POLICIES",
    "CacheClosedError",
    "CacheConfig",
    "CacheDirLockedError",
    "CacheManager",
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
    "blend_root",
    "chunk_key",
    "namespace_key",
    "plan_chunks",
    "tokens_digest",
]

if TYPE_CHECKING:
    from pcr_rag.cache.clock import Clock, ManualClock, MonotonicClock
    from pcr_rag.cache.config import POLICIES, CacheConfig, RemoteConfig
    from pcr_rag.cache.errors import (
        CacheClosedError,
        CacheDirLockedError,
        CacheError,
        ChunkNotFoundError,
        CorruptChunkError,
    )
    from pcr_rag.cache.keys import (
        KEY_BYTES,
        ChunkSpec,
        blend_root,
        chunk_key,
        namespace_key,
        plan_chunks,
        tokens_digest,
    )
    from pcr_rag.cache.manager import CacheManager, Lease, MatchResult
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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        from pcr_rag._moved import renamed

        return renamed(__name__, name)  # a deprecated name, else AttributeError
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
