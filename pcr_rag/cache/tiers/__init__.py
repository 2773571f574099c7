"""The tiers of the cache behind one interface (``base.KVTier``): ``memory`` (device and DRAM copies) and
``ssd`` (chunk files: ``chunk_file`` format, ``ssd_store`` on a storage backend). ``build_tiers`` wires the
active ones for a config."""

from __future__ import annotations

import torch

from pcr_rag.cache.config import CacheConfig
from pcr_rag.cache.storage import StorageBackend
from pcr_rag.cache.tiers.base import KVTier, Tier, TierKind
from pcr_rag.cache.tiers.memory import MemoryTier
from pcr_rag.cache.tiers.ssd import SsdTier, open_ssd_tier

__all__ = ["KVTier", "MemoryTier", "SsdTier", "Tier", "TierKind", "build_tiers", "open_ssd_tier"]


def build_tiers(config: CacheConfig, storage: StorageBackend | None) -> list[KVTier]:
    """The active tiers of an engine, fastest first: one line of wiring per tier."""
    tiers: list[KVTier] = []
    if config.has_device_tier:
        tiers.append(MemoryTier(Tier.DEVICE, int(config.device_bytes), device=torch.device(config.device)))
    tiers.append(MemoryTier(Tier.DRAM, int(config.dram_bytes), pin_memory=config.pin_dram))
    ssd = open_ssd_tier(config, storage)
    if ssd is not None:
        tiers.append(ssd)
    return tiers
