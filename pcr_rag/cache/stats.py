"""CacheStats: a snapshot of the engine's counters (chunks, tokens, bytes) taken under the engine lock."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pcr_rag.cache.tiers.base import TIER_ORDER

__all__ = ["CacheStats"]


def _tiers() -> dict[str, int]:
    return {t.value: 0 for t in TIER_ORDER}


@dataclass
class CacheStats:
    """Counters since the engine started. Per-tier dicts are keyed ``"device"``, ``"dram"``, ``"ssd"``, ``"remote"``.

    - ``hit_chunks`` / ``hit_tokens``: chunks/tokens matched by ``acquire``, by the fastest tier holding them.
    - ``miss_chunks`` / ``miss_tokens``: requested but not matched (tokens known when the caller passed
      ``ChunkSpec``s or ``total_tokens``).
    - ``evictions[t]``: chunks removed from tier t by the policy; ``demotions[t]`` is the part of those that
      still had a copy in a slower tier (e.g. DRAM -> SSD), the rest were dropped from the cache.
    - ``loads``: SSD -> DRAM chunk loads; ``prefetch_loads``: those issued through ``load_async``.
    - ``writes_done`` / ``writes_failed`` / ``writes_skipped``: DRAM -> SSD write-backs (failed = I/O error such
      as ENOSPC, write-throughs included; skipped = no SSD room could be made); ``writeback_queue_depth``: queued
      + in flight now.
    - ``write_through``: chunks inserted straight into SSD because no memory tier had room (e.g. DRAM full of
      chunks pinned by running requests); they count in ``inserts`` too.
    - ``pinned_chunks``: chunks pinned now (held by leases, loads in flight or SSD layer reads); 0 when idle.
    - ``dram_buffers_reused``: new chunks' DRAM payloads written into the buffer of a dropped DRAM copy instead of
      a fresh tensor (no first-touch page faults; see ``BufferPool``).
    - ``corrupt_chunks_dropped``: SSD chunks that failed verification (at read or at start-up) and were deleted;
      ``orphans_dropped``: chunks dropped at start-up because their parent was missing.
    - ``bytes_used`` / ``bytes_high_water`` / ``capacity_bytes`` / ``chunks``: per tier, now.
    - ``quota_refusals[t]``: room refused in tier t because the tenant asking was at its per-tenant quota and none
      of its own chunks there could go (``CacheConfig.tenant_dram_bytes`` / ``tenant_ssd_bytes``);
      ``tenants[t]``: tenants charged bytes in tier t now (``CacheManager.tenant_bytes`` gives their bytes).
    - ``remote_io``: the remote tier's counters (empty without one): ``lookups`` (round trips), ``lookup_found``
      and ``misses`` (chunks), ``hits`` (values read and verified), ``errors``, ``skipped`` (calls the open
      circuit breaker refused), ``corrupt`` (values that failed verification, deleted), ``forged`` (values whose
      MAC failed or whose authenticated header contradicts the reader's root, plan or KV layout: deleted and
      recomputed), ``bytes_read`` /
      ``bytes_written``, ``writes`` / ``writes_existing`` (``SET NX`` found one) / ``writes_dropped`` (queue full
      or breaker open) / ``writes_failed``, ``recompute_chosen`` (remote chunks not loaded because recomputing
      was cheaper), ``breaker_open`` (0/1) and ``breaker_trips``, ``rtt_s``, ``read_bytes_per_s``,
      ``compute_s_per_token`` (the measured speeds the load-or-recompute decision uses), ``write_queue_depth``,
      ``latency_s`` (mean/p50/p95/p99 of recent calls, seconds). On a cluster (``redis+cluster://``), also
      ``nodes`` / ``nodes_open`` (primaries known / with an open per-node breaker), ``node_errors``,
      ``node_skipped``, ``node_breaker_trips``, ``redirects`` (MOVED followed) and ``slot_map_refreshes``. Once
      the start-up census of the store's root manifests has run (``RemoteTier.start_census``): ``roots_seen``
      (manifests read), ``roots_of_other_identity`` (those naming another model, dtype, chunk size, plan or kernel
      identity: their chunks are never served here), ``roots_unreadable`` (malformed, oversized or failing their
      MAC) and ``roots_census_complete`` (0: the bounded scan saw part of the store).
    - ``recomputed_instead_of_loaded``: per tier, cached chunks that requests recomputed because the planner found
      loading them slower (``cache.reuse_planner``; the remote entry is also ``remote_io["recompute_chosen"]``).
    - ``planner``: the planner's mode and estimates: ``read_bytes_per_s`` and ``read_latency_s`` per tier (0:
      not measured yet; the remote tier's are ``remote_io``'s ``read_bytes_per_s`` / ``rtt_s``),
      ``compute_s_per_token`` and ``compute_s_per_token_position`` (the prefill cost's position term).
    """

    hit_chunks: dict[str, int] = field(default_factory=_tiers)
    hit_tokens: dict[str, int] = field(default_factory=_tiers)
    miss_chunks: int = 0
    miss_tokens: int = 0
    lookups: int = 0
    inserts: int = 0
    inserts_rejected: int = 0
    superseded: int = 0
    evictions: dict[str, int] = field(default_factory=_tiers)
    demotions: dict[str, int] = field(default_factory=_tiers)
    loads: int = 0
    prefetch_loads: int = 0
    load_failures: int = 0
    writes_done: int = 0
    writes_failed: int = 0
    writes_skipped: int = 0
    write_through: int = 0
    writeback_queue_depth: int = 0
    pinned_chunks: int = 0
    dram_buffers_reused: int = 0
    corrupt_chunks_dropped: int = 0
    orphans_dropped: int = 0
    recovered_chunks: int = 0
    nodes: int = 0
    bytes_used: dict[str, int] = field(default_factory=_tiers)
    bytes_high_water: dict[str, int] = field(default_factory=_tiers)
    capacity_bytes: dict[str, int] = field(default_factory=_tiers)
    chunks: dict[str, int] = field(default_factory=_tiers)
    quota_refusals: dict[str, int] = field(default_factory=_tiers)
    tenants: dict[str, int] = field(default_factory=_tiers)
    remote_io: dict[str, object] = field(default_factory=dict)
    recomputed_instead_of_loaded: dict[str, int] = field(default_factory=_tiers)
    planner: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def hit_ratio_tokens(self) -> float:
        hits = sum(self.hit_tokens.values())
        total = hits + self.miss_tokens
        return hits / total if total else 0.0
