"""CacheManager: the locked front of the cache. It wires the parts and owns the request-facing calls.

Parts, each testable on its own: ``ResidencyIndex`` (prefix tree, which tier holds what, budgets, eviction), the
tiers behind ``tiers.base.KVTier`` (device and DRAM memory, SSD files, the shared remote store), ``WriteBack``
(memory -> SSD, and write-through), ``RemoteReuse`` (remote lookups, remote write-through), ``ReusePlanner`` (load
or recompute, for every tier, from measured speeds), ``Loader`` (storage -> DRAM, verified and timed reads) and the
objects callers hold (``lease``). One ``CacheLock`` guards
all metadata; payload copies and I/O run outside it. The contract is in docs/DESIGN.md ("Cache engine"); an insert
that finds no memory room is written through to SSD, so a small DRAM never switches caching off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from pcr_rag.cache.buffer_pool import BufferPool
from pcr_rag.cache.clock import Clock, MonotonicClock
from pcr_rag.cache.config import CacheConfig
from pcr_rag.cache.keys import KEY_BYTES, ChunkSpec, tokens_digest
from pcr_rag.cache.lease import ChunkLayerReader, Lease, MatchResult
from pcr_rag.cache.loader import Loader
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.node import CacheNode, fastest_tier
from pcr_rag.cache.payload import Payload, VirtualPayload, payload_num_layers, validate_payload
from pcr_rag.cache.policy import make_policy
from pcr_rag.cache.recovery import recover
from pcr_rag.cache.remote_reuse import RemoteReuse
from pcr_rag.cache.residency import ResidencyIndex
from pcr_rag.cache.reuse_planner import ReusePlan, ReusePlanner, Segment
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.storage import StorageBackend
from pcr_rag.cache.tiers import MemoryTier, build_tiers
from pcr_rag.cache.tiers.base import UNATTRIBUTED, ChunkRecord, KVTier, Tier, TierKind, tier_bit
from pcr_rag.cache.writeback import WriteBack

__all__ = ["CacheManager", "Lease", "MatchResult"]

log = logging.getLogger(__name__)


class CacheManager:
    """The PCR cache engine. Thread-safe. See the module docstring and docs/DESIGN.md for the contract."""

    def __init__(
        self, config: CacheConfig, *, clock: Clock | None = None, storage: StorageBackend | None = None
    ) -> None:
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._sync = CacheLock()
        self._lock = self._sync.lock
        self._stats = CacheStats()
        self._tiers = build_tiers(config, storage, self.clock)
        self._memory = [t for t in self._tiers if t.kind is TierKind.MEMORY]
        self._dram: MemoryTier = next(t for t in self._memory if t.tier is Tier.DRAM)  # type: ignore[assignment]
        self._memory_bits = sum(tier_bit(t.tier) for t in self._memory)
        # the write-back target: local storage (SSD); the shared remote tier is written through by RemoteReuse
        self._storage = next((t for t in self._tiers if t.kind is TierKind.STORAGE and not t.shared), None)
        self._index = ResidencyIndex(self._tiers, make_policy(config.policy), self.clock, self._stats,
                                     quotas={Tier.DRAM: config.tenant_dram_bytes, Tier.SSD: config.tenant_ssd_bytes})
        try:
            recover(self._tiers, self._index, self._sync)
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        self._writeback = WriteBack(
            self._sync,
            self._index,
            self._storage,
            self._stats,
            inline=config.sync_io,
            wait_s=config.writeback_wait_s,
        )
        remote = next((t for t in self._tiers if t.tier is Tier.REMOTE), None)
        self._remote: RemoteReuse | None = None
        if remote is not None and config.remote is not None:
            self._remote = RemoteReuse(self._sync, self._index, remote,  # type: ignore[arg-type]
                                       write_queue=config.remote.write_queue, inline=config.sync_io)
        self.planner = ReusePlanner(
            config.load_planner,
            remote_seconds=self._remote.client.load_seconds if self._remote is not None else None,
            memory_copies_overlap=config.device.startswith("cuda"),
            clock=self.clock.now,
        )
        self._loader = Loader(
            self._sync,
            self._index,
            self._writeback,
            self._stats,
            workers=None if config.sync_io else config.io_workers,
            on_read=self.planner.record_read,
            timer=self.clock.now,
        )

    # ================================================================== queries
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The active tiers, fastest first."""
        return tuple(t.tier for t in self._tiers)

    @property
    def host_buffers(self) -> BufferPool | None:
        """Where new chunks' DRAM payloads come from: the buffers of dropped DRAM copies (None when DRAM copies
        are pinned)."""
        return self._dram.buffers

    @property
    def ssd_enabled(self) -> bool:
        return self._storage is not None

    @property
    def storage_tier(self) -> KVTier | None:
        """The local storage (SSD) tier, recovered (its per-root ``census``, ``note_root``); None without one."""
        return self._storage

    @property
    def remote_enabled(self) -> bool:
        return self._remote is not None

    @property
    def remote(self) -> RemoteReuse | None:
        """The remote tier's lookups, decisions and measured speeds (None without one)."""
        return self._remote

    def __len__(self) -> int:
        return len(self._index.tree)

    def __contains__(self, key: object) -> bool:
        return key in self._index.tree

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        """Tiers holding ``key`` now (empty when not cached)."""
        with self._lock:
            node = self._index.get(key)
            return node.tiers() if node is not None else frozenset()

    def leaf_keys(self, tier: Tier | None = None) -> list[bytes]:
        """Keys of the leaves, least recently used first: the tree's leaves (``tier=None``) or one tier's
        eviction leaves (resident there, no child resident there)."""
        with self._lock:
            if tier is None:
                nodes = sorted(self._index.tree.leaves, key=lambda n: (n.used_at, n.use_seq))  # type: ignore[attr-defined]
            else:
                nodes = self._index.orders[Tier(tier)].ordered()
            return [n.key for n in nodes]

    @property
    def protected(self) -> frozenset[bytes]:
        return self._index.protected

    def match(self, keys: Sequence[bytes]) -> MatchResult:
        """Read-only walk from the root: the longest cached prefix of ``keys``; no pin, no LRU touch, no stats."""
        with self._lock:
            nodes = self._index.tree.match(keys)
            return MatchResult(
                keys=tuple(n.key for n in nodes),
                tiers=tuple(n.fastest() for n in nodes),  # type: ignore[attr-defined]
                locations=tuple(n.tiers() for n in nodes),  # type: ignore[attr-defined]
                num_tokens=sum(n.num_tokens for n in nodes),
            )

    def acquire(
        self,
        keys: Sequence[bytes | ChunkSpec],
        max_chunks: int | None = None,
        *,
        total_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> Lease:
        """Match, pin the matched nodes, LRU-touch them and count hits/misses by tier.

        ``keys`` may be chunk keys or ``ChunkSpec``s (then miss tokens are exact); with plain keys, pass
        ``total_tokens`` (tokens covered by the considered keys) to count miss tokens. ``max_chunks`` caps the
        match (and hit/miss counting). With a remote tier, the chunks after the local match are looked up there
        first (``discover``). The match ends where the planner finds that loading the rest would take longer
        than recomputing it (``prompt_tokens``: the request's prompt, which the compute estimate covers; None:
        the matched chunks); those chunks count as misses and in ``recomputed_instead_of_loaded``."""
        raw = [k.key if isinstance(k, ChunkSpec) else k for k in keys]
        limit = len(raw) if max_chunks is None else max(0, min(len(raw), max_chunks))
        if self._remote is not None and limit:
            self._remote.discover(keys[:limit])  # ChunkSpecs: checked against the plan
        if limit:
            self._probe_storage(raw[:limit])
        with self._lock:
            self._sync.check_open()
            nodes: list[CacheNode] = self._index.tree.match(raw, limit)  # type: ignore[assignment]
            plan = self._plan(nodes, prompt_tokens)
            if plan.skipped:
                self.planner.count(plan)
                log.debug("reuse plan: %d of %d cached chunks loaded, recomputing %s (estimated %.4f s to the "
                          "last prefill layer)", plan.reuse, len(nodes), _tier_counts(plan.skipped),
                          plan.seconds if plan.seconds is not None else float("nan"))
            nodes = nodes[: plan.reuse]
            tiers = tuple(fastest_tier(n.resident_mask) for n in nodes)
            self._index.pin_and_touch(nodes)
            st = self._stats
            st.lookups += 1
            hit_tokens = 0
            for n, t in zip(nodes, tiers, strict=True):
                name = t.value  # type: ignore[union-attr]
                st.hit_chunks[name] += 1
                st.hit_tokens[name] += n.num_tokens
                hit_tokens += n.num_tokens
            st.miss_chunks += limit - len(nodes)
            if keys and all(isinstance(k, ChunkSpec) for k in keys[:limit]):
                st.miss_tokens += sum(k.num_tokens for k in keys[len(nodes) : limit])  # type: ignore[union-attr]
            elif total_tokens is not None:
                st.miss_tokens += max(0, total_tokens - hit_tokens)
        return Lease(nodes, tiers, self._loader.release)  # type: ignore[arg-type]

    def discover(self, keys: Sequence[bytes]) -> int:
        """Look up in the remote tier the chunks of the chain ``keys`` after the local match (one round trip) and
        add the ones found to the tree; returns how many (0 without a remote tier, or while it is skipped)."""
        return self._remote.discover(keys) if self._remote is not None else 0

    def reuse_limit(self, keys: Sequence[bytes], prompt_tokens: int | None = None) -> int:
        """How many leading chunks of ``keys`` are cached and worth loading now (the planner's decision, as
        ``acquire`` makes it, uncounted): the prefetcher loads no further."""
        with self._lock:
            nodes: list[CacheNode] = self._index.tree.match(keys)  # type: ignore[assignment]
            return self._plan(nodes, prompt_tokens).reuse

    def _plan(self, nodes: Sequence[CacheNode], prompt_tokens: int | None) -> ReusePlan:
        """The planner's decision over a matched path (lock held)."""
        if not nodes:
            return ReusePlan(0, None)
        loading = self._loader.loading
        segments = [Segment(n.key, n.fastest(), n.num_tokens, n.nbytes, n.num_layers, loading(n)) for n in nodes]
        available = self._remote is None or self._remote.client.available()
        return self.planner.plan(segments, prompt_tokens, remote_available=available)

    def _probe_storage(self, keys: Sequence[bytes]) -> None:
        """When the SSD tier's read speed is unknown or stale (``ReusePlanner.needs_probe``), time one layer read
        of the first matched chunk that sits there (the planner's cold start: the first request decides from a
        measurement, not a guess). A failed probe changes nothing (the read drops a bad copy, as any read does)."""
        if not self.planner.needs_probe(Tier.SSD):
            return
        with self._lock:
            probe = next((n.key for n in self._index.tree.match(keys)  # type: ignore[attr-defined]
                          if n.fastest() is Tier.SSD and not n.virtual), None)
        if probe is not None:
            try:
                self._loader.read_layer(probe, 0)
            except Exception as exc:  # noqa: BLE001 - a probe is an optimisation; the request decides without it
                log.debug("read-speed probe of chunk %s failed: %s", probe.hex()[:12], exc)

    def record_compute(self, tokens: int, seconds: float, start: int = 0) -> None:
        """A measured prefill step (``tokens`` positions from ``start`` computed in ``seconds``) for the
        load-or-recompute decision."""
        self.planner.record_compute(tokens, seconds, start)

    def get_payload(self, key: bytes) -> Payload | None:
        """The chunk's payload when it is in device memory or DRAM (device preferred), else None. Hold a Lease
        while using it; the caller must not modify it."""
        return self._loader.get_payload(key)

    def read_layer(self, key: bytes, layer: int) -> torch.Tensor | VirtualPayload:
        """Layer ``layer`` of a chunk, ``[2, kv_heads, tokens, head_dim]``, from the fastest tier holding it; from
        storage only that layer is read, and verified. Raises ChunkNotFoundError when not cached and
        CorruptChunkError (after dropping the copy) when the stored copy fails verification."""
        return self._loader.read_layer(key, layer)

    def open_layer_reader(self, key: bytes) -> ChunkLayerReader:
        """A reader of one chunk's layers for a layer-wise load: from memory when resident (views, no copy),
        else from storage with the chunk opened and its header verified once. The chunk stays pinned until the
        reader is closed. A layer that fails verification raises CorruptChunkError and that copy is dropped."""
        return self._loader.open_layer_reader(key)

    def pending_loads(self, keys: Iterable[bytes]) -> list[Future[None]]:
        """Futures of storage -> DRAM loads in flight for any of ``keys`` (e.g. a prefetch a request can wait for
        instead of reading the same chunk a second time)."""
        return self._loader.pending(keys)

    def load(self, keys: Sequence[bytes]) -> int:
        """Bring the given chunks from storage into DRAM now (those in no memory tier); returns chunks loaded by
        this call. Also waits for loads of the same chunks already in flight (those count for their caller)."""
        return self._loader.load(keys)

    def load_async(self, keys: Sequence[bytes]) -> Future[int]:
        """Same as ``load`` on the I/O pool (inline with ``sync_io``); the future resolves once every given chunk
        that was in storage only is loaded (or failed), including loads already in flight. The nodes are pinned
        from this call until their load ends. Counted as prefetch loads."""
        return self._loader.load_async(keys)

    # ================================================================== insert
    def insert(self, spec: ChunkSpec, payload: Payload, *, tokens: Sequence[int] | None = None,
               tenant: bytes = UNATTRIBUTED) -> bool:
        """Store a chunk in the memory tiers and queue its write-back; written through to SSD instead when no
        memory tier can make room.

        The parent must be the namespace root (``spec.start == 0``) or in the tree. The engine takes ownership
        of ``payload`` (do not modify it afterwards). Returns False, storing nothing, when no tier has room or the
        parent is gone. Inserting a key already cached only touches it (and brings it back into DRAM if it was
        only in storage). ``tokens`` (the chunk's token ids) enable the supersede rule: a partial chunk keeps a
        digest of its tokens, and inserting a full chunk whose tokens start with them drops that partial leaf
        sibling (or, if it is in use, moves it to the front of the eviction order). ``tenant``: whom the chunk's
        bytes are charged to if this insert stores it (the request's tenant: `PCREngine.root_for` of its
        namespace), for the per-tenant quotas (``cache.residency``); an insert of a cached key charges nobody."""
        payload = validate_payload(payload, spec.num_tokens)
        if tenant and len(tenant) != KEY_BYTES:
            raise ValueError(f"tenant must be a {KEY_BYTES}-byte root key or b'' (none), got {len(tenant)} bytes")
        if tokens is not None and len(tokens) != spec.num_tokens:
            raise ValueError(f"tokens has {len(tokens)} ids but the chunk spans {spec.num_tokens} tokens")
        digest = tokens_digest(tokens) if (tokens is not None and spec.partial) else None
        virtual = isinstance(payload, VirtualPayload)
        # positional (the insert hot path): key, parent_key, parent_is_root, num_tokens, partial, tokens_digest,
        # nbytes, num_layers, virtual, charged_bytes, tenant
        chunk = ChunkRecord(
            spec.key,
            spec.parent,
            spec.start == 0,
            spec.num_tokens,
            spec.partial,
            digest,
            int(payload.nbytes),
            payload_num_layers(payload),
            virtual,
            0,
            tenant,
        )
        placed = [(t, t.place(payload)) for t in self._memory]
        index = self._index
        write_inline: CacheNode | None = None
        through = False
        with self._lock:
            self._sync.check_open()
            existing = index.get(spec.key)
            refresh = existing is not None and self._writeback.refresh(
                existing, next(copy for t, copy in placed if t is self._dram))
        if existing is not None:
            if refresh:
                self._writeback.write(existing)
            return True
        with self._lock:
            self._sync.check_open()
            if spec.key in self._writeback.writing_through or index.get(spec.key) is not None:
                return True  # another thread is storing (or stored) this very chunk
            parent = None if chunk.parent_is_root else index.get(spec.parent)
            if not chunk.parent_is_root and parent is None:
                self._stats.inserts_rejected += 1
                return False
            if parent is not None:
                parent.tree_holds += (
                    1  # keep the parent in the tree while room is made (the lock may be released)
                )
            try:
                reserved = [
                    (t, copy) for t, copy in placed if self._writeback.make_room(t.tier, t.charge(chunk), tenant)
                ]
                existing = index.get(spec.key)  # re-check: the lock may have been released for room
                parent_gone = parent is not None and parent.removed
                written_elsewhere = spec.key in self._writeback.writing_through
                if existing is not None or written_elsewhere or parent_gone or not reserved:
                    for t, _ in reserved:
                        index.release(t.tier, t.charge(chunk), tenant)
                if existing is not None:
                    index.touch(existing)
                if existing is not None or written_elsewhere:
                    return True
                if parent_gone or (not reserved and not self._writeback.reserve_through(chunk)):
                    self._stats.inserts_rejected += 1
                    return False
                through = not reserved
                if reserved:
                    node = index.add_node(chunk)
                    for t, copy in reserved:
                        t.store(node, copy)
                        index.mark_resident(node, t.tier)
                    index.inserted(node, tokens)
                    if self._storage is not None and self._writeback.enqueue(node):
                        write_inline = node
            finally:
                if parent is not None and not through:
                    parent.tree_holds -= 1
        stored = True
        if through:
            stored = self._writeback.write_through(chunk, payload, parent, tokens)
        elif write_inline is not None:
            self._writeback.write(write_inline)
        if stored and self._remote is not None:
            self._remote.offer(chunk, payload)  # landed locally: on to the shared store
        return stored

    # ================================================================== protection / explicit eviction
    def set_lookahead(self, keys: Iterable[bytes]) -> None:
        """Replace the protected set: the chunks the waiting window needs (evicted last under look-ahead LRU)."""
        protected = frozenset(keys)
        with self._lock:
            self._index.protected = protected

    def evict(self, tier: Tier, nbytes: int) -> int:
        """Evict from ``tier`` by policy until ``nbytes`` are freed or no candidate is left; returns bytes freed.
        (Tests and the simulator; inserts and loads evict on their own.)"""
        with self._lock:
            return self._index.evict(Tier(tier), nbytes)

    # ================================================================== lifecycle / stats
    def flush(self, timeout: float | None = None) -> None:
        """Wait until the write-back queue (and the remote write queue) is drained; raise TimeoutError after
        ``timeout`` seconds (for each)."""
        self._writeback.flush(timeout)
        if self._remote is not None:
            self._remote.flush(timeout)

    def close(self) -> None:
        """Flush write-back, stop the I/O threads, release the cache directory lock. Idempotent."""
        with self._lock:
            if self._sync.closed:
                return
        self.flush()
        with self._lock:
            self._sync.closed = True
        self._writeback.stop()
        if self._remote is not None:
            self._remote.stop()
        self._loader.shutdown()
        for tier in self._tiers:
            tier.close()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> CacheStats:
        with self._lock:
            st = CacheStats(
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self._stats).items()}
            )
            st.writeback_queue_depth = self._writeback.depth
            st.recomputed_instead_of_loaded = dict(self.planner.recomputed)
            st.planner = self.planner.snapshot()
            if self._remote is not None:
                st.remote_io = self._remote.counters()
                st.remote_io["recompute_chosen"] = st.recomputed_instead_of_loaded[Tier.REMOTE.value]
                st.remote_io["compute_s_per_token"] = st.planner["compute_s_per_token"]
                census = self._remote.tier.roots  # the start-up census of the store's root manifests, once run
                if census is not None:
                    st.remote_io.update(census.counters())
            st.pinned_chunks = self._index.pinned
            if self._dram.buffers is not None:
                st.dram_buffers_reused = self._dram.buffers.reused
            st.nodes = len(self._index.tree)
            for t, b in self._index.budgets.items():
                st.bytes_used[t.value] = b.used
                st.bytes_high_water[t.value] = b.high_water
                st.capacity_bytes[t.value] = b.capacity
                st.chunks[t.value] = b.chunks
                st.tenants[t.value] = len(b.by_tenant)
            return st

    def tenant_bytes(self, tier: Tier) -> dict[bytes, int]:
        """Bytes charged to each tenant in ``tier`` now (stored and reserved; `UNATTRIBUTED` for chunks of no
        known tenant); the quotas bound these."""
        with self._lock:
            return dict(self._index.budgets[Tier(tier)].by_tenant)

    def check_invariants(self) -> None:
        """Assert every structural and accounting invariant (tests; O(nodes)). With transfers in flight the byte
        counts include reservations, so the exact byte equality is checked only when the engine is quiet."""
        with self._lock:
            self._index.check(quiet=self._writeback.idle and self._loader.idle)


def _tier_counts(tiers: Sequence[Tier]) -> str:
    """'2 ssd, 1 remote': chunks per tier, for the planner's log line."""
    counts: dict[str, int] = {}
    for t in tiers:
        counts[t.value] = counts.get(t.value, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def __getattr__(name: str) -> object:
    from pcr_rag._moved import renamed

    return renamed(__name__, name)  # CacheEngine: the old name of CacheManager, else AttributeError
