"""Restart recovery: rebuild the prefix tree from what the persistent tiers still hold.

Each tier's ``recover`` lists its valid copies, oldest write first, after deleting the ones that fail
verification. Nodes are rebuilt parents first (a chunk whose parent is missing is an orphan: its copy is deleted
and counted), charged to the tenant the copy records (``ChunkRecord.tenant``), stamped least recently used in write
order, and the tier is trimmed to each tenant's quota (own leaves first) and then to its budget by policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.node import CacheNode
from pcr_rag.cache.residency import ResidencyIndex
from pcr_rag.cache.tiers.base import ChunkRecord, KVTier, Tier

__all__ = ["recover", "restore"]

log = logging.getLogger(__name__)


def restore(index: ResidencyIndex, tier: Tier, chunks: Sequence[ChunkRecord]) -> list[ChunkRecord]:
    """Add the nodes of ``chunks`` (recovered by ``tier``, oldest write first) to ``index``, then trim the tier
    to its budget. Returns the orphans; the caller drops their copies. Lock held."""
    by_parent: dict[bytes, list[ChunkRecord]] = {}
    for c in chunks:
        by_parent.setdefault(c.parent_key, []).append(c)
    budget = index.budgets[tier]
    added: dict[bytes, CacheNode] = {}
    frontier = [c for c in chunks if c.parent_is_root]
    while frontier:
        next_frontier: list[ChunkRecord] = []
        for c in frontier:
            if c.key in added:
                continue
            node = index.add_node(c)
            budget.take(c.charged_bytes, c.tenant)  # trimmed below if the tier holds more than its budget
            index.mark_resident(node, tier)
            added[c.key] = node
            next_frontier.extend(by_parent.get(c.key, ()))
        frontier = next_frontier
    for c in chunks:  # oldest write = least recently used
        node = added.get(c.key)
        if node is not None:
            index.touch(node)
    index.trim_to_quota(tier)
    if budget.used > budget.capacity:
        index.evict(tier, budget.used - budget.capacity)
    budget.high_water = budget.used
    return [c for c in chunks if c.key not in added]


def recover(tiers: Sequence[KVTier], index: ResidencyIndex, sync: CacheLock) -> None:
    """Rebuild ``index`` from every tier's recovered copies (volatile tiers have none); counts in the stats."""
    stats = index.stats
    for tier in tiers:
        found = tier.recover()
        with sync.lock:
            stats.corrupt_chunks_dropped += found.corrupt
            orphans = restore(index, tier.tier, found.chunks)
            for chunk in orphans:
                tier.drop(chunk)
            stats.orphans_dropped += len(orphans)
            stats.recovered_chunks = len(index.tree)
        if found.chunks or found.corrupt:
            log.info(
                "%s cache %s: recovered %d chunks, dropped %d corrupt and %d orphan copies",
                tier.tier.value,
                tier.describe(),
                len(found.chunks) - len(orphans),
                found.corrupt,
                len(orphans),
            )
