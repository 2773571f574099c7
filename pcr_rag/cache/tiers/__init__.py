"""The tiers of the cache behind one interface (``base.KVTier``): ``memory`` (device and DRAM copies), ``ssd``
(chunk files: ``chunk_file`` format, ``ssd_store`` on a storage backend) and ``remote`` (values in a store shared
by replicas: ``remote_value`` format, ``remote_store``, ``remote_client``). ``build_tiers`` wires the active ones
for a config."""

from __future__ import annotations

import torch

from pcr_rag.cache.buffer_pool import BufferPool
from pcr_rag.cache.clock import Clock
from pcr_rag.cache.config import CacheConfig
from pcr_rag.cache.storage import StorageBackend
from pcr_rag.cache.tiers.base import KVTier, Tier, TierKind
from pcr_rag.cache.tiers.breaker import CircuitBreaker
from pcr_rag.cache.tiers.memory import MemoryTier
from pcr_rag.cache.tiers.remote import RemoteTier, open_remote_tier
from pcr_rag.cache.tiers.ssd import SsdTier, open_ssd_tier

__all__ = [
    "KVTier",
    "MemoryTier",
    "RemoteTier",
    "SsdTier",
    "Tier",
    "TierKind",
    "build_tiers",
    "open_remote_tier",
    "open_ssd_tier",
]


def build_tiers(config: CacheConfig, storage: StorageBackend | None, clock: Clock | None = None) -> list[KVTier]:
    """The active tiers of an engine, fastest first: one line of wiring per tier (``clock`` times the remote
    tier's circuit breaker)."""
    tiers: list[KVTier] = []
    if config.has_device_tier:
        tiers.append(MemoryTier(Tier.DEVICE, int(config.device_bytes), device=torch.device(config.device)))
    # unpinned DRAM copies go back to a pool when dropped, for new payloads (pinned ones are the CUDA path's)
    buffers = None if config.pin_dram else BufferPool()
    tiers.append(MemoryTier(Tier.DRAM, int(config.dram_bytes), pin_memory=config.pin_dram, buffers=buffers))
    ssd = open_ssd_tier(config, storage)
    if ssd is not None:
        tiers.append(ssd)
    if config.remote is not None:
        r = config.remote
        tiers.append(open_remote_tier(r, breaker=CircuitBreaker(r.breaker_errors, r.breaker_backoff_s, clock)))
    return tiers
