"""The tiers of the cache behind one interface (``base.KVTier``): ``memory`` (device and DRAM copies) and
``ssd`` (chunk files: ``chunk_file`` format, ``ssd_store`` on a storage backend)."""

from pcr_rag.cache.tiers.base import (
    TIER_ORDER,
    ChunkRecord,
    ChunkRef,
    KVTier,
    LayerSource,
    PayloadLayers,
    Tier,
    TierKind,
    TierRecovery,
    tier_bit,
)
from pcr_rag.cache.tiers.memory import MemoryTier
from pcr_rag.cache.tiers.ssd import SsdTier, open_ssd_tier

__all__ = [
    "TIER_ORDER",
    "ChunkRecord",
    "ChunkRef",
    "KVTier",
    "LayerSource",
    "MemoryTier",
    "PayloadLayers",
    "SsdTier",
    "Tier",
    "TierKind",
    "TierRecovery",
    "open_ssd_tier",
    "tier_bit",
]
