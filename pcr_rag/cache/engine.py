"""CacheEngine: match / acquire / insert / evict / load / write-back of chunk KV across device, DRAM and SSD.

Model (see docs/DESIGN.md, "Cache engine"):
- A chunk node is in the prefix tree iff its KV is in at least one tier; its parent is always in the tree.
- Each tier has a byte budget that is never exceeded: bytes are *reserved* under the engine lock before any copy
  or disk write, and released when a copy is dropped. The high-water mark is tracked.
- Eviction from a tier takes that tier's leaves (resident nodes with no child resident in the same tier) in the
  policy's order (LRU; look-ahead LRU offers protected chunks last), never pinned nodes. Dropping a copy that
  leaves the node in no tier removes it from the tree, which is allowed only for nodes without children.
  A memory copy whose SSD write-back is still pending is not a candidate (no data loss): an insert that needs its
  room waits up to ``writeback_wait_s`` for the writer instead.
- Every chunk inserted into memory is queued for write-back to SSD (one background writer thread, or inline with
  ``sync_io``). Loads (SSD -> DRAM) pin their nodes; writes happen only for chunks not yet on SSD, and a chunk
  being written stays in memory, so a load and a write of one chunk never race.
- One engine lock guards all metadata; payload copies and disk I/O run outside it.
- Payloads are tensors ``[layers, 2, kv_heads, tokens, head_dim]`` or metadata-only ``VirtualPayload`` s (the
  simulator's mode: same accounting and policy, no bytes; the SSD tier keeps only index entries for them).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pcr_rag.cache.clock import Clock, MonotonicClock
from pcr_rag.cache.config import CacheConfig
from pcr_rag.cache.errors import CacheClosedError, CacheDirLockedError, ChunkNotFoundError, CorruptChunkError
from pcr_rag.cache.keys import ChunkSpec, tokens_digest
from pcr_rag.cache.payload import Payload, VirtualPayload, payload_num_layers, validate_payload
from pcr_rag.cache.policy import LeafOrder, make_policy
from pcr_rag.cache.prefix_tree import Node, PrefixTree
from pcr_rag.cache.ssd import ChunkMeta, SSDStore, chunk_file_bytes
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.storage import LocalDirBackend, StorageBackend
from pcr_rag.cache.tiers import TIER_ORDER, Tier, TierBudget, tier_bit

__all__ = ["CacheEngine", "Lease", "MatchResult"]

log = logging.getLogger(__name__)

DEV_BIT = tier_bit(Tier.DEVICE)
DRAM_BIT = tier_bit(Tier.DRAM)
SSD_BIT = tier_bit(Tier.SSD)
MEM_BITS = DEV_BIT | DRAM_BIT
_ZERO_DIGEST = b"\x00" * 16

# write-back states of a node
WB_NONE = 0  # nothing to write (on SSD already, or no SSD tier)
WB_QUEUED = 1
WB_WRITING = 2
WB_FAILED = 3  # I/O error (e.g. ENOSPC): stays memory-only
WB_SKIPPED = 4  # no SSD room could be made
_PENDING = "pending"
_MASK_TIERS = [frozenset(t for t in TIER_ORDER if m & tier_bit(t)) for m in range(8)]
_MASK_FASTEST = [next((t for t in TIER_ORDER if m & tier_bit(t)), None) for m in range(8)]


class CacheNode(Node):
    """A chunk node with its tier state. ``resident`` is a bit mask of tiers; ``child_res[i]`` counts children
    resident in tier ``TIER_ORDER[i]``; ``pins`` counts leases/loads holding it (no eviction from any tier);
    ``keep`` counts internal holds that only keep it in the tree (demotion allowed, removal not);
    ``tick``/``atime`` order LRU."""

    __slots__ = (
        "nbytes",
        "num_layers",
        "partial",
        "virtual",
        "digest",
        "resident",
        "child_res",
        "tick",
        "atime",
        "pins",
        "keep",
        "dram",
        "dev",
        "wb",
        "dead",
    )

    def __init__(self, key: bytes, parent: Node, num_tokens: int) -> None:
        super().__init__(key, parent, num_tokens)
        self.nbytes = 0
        self.num_layers = 1
        self.partial = False
        self.virtual = False
        self.digest: bytes | None = None
        self.resident = 0
        self.child_res = [0, 0, 0]
        self.tick = 0
        self.atime = 0.0
        self.pins = 0
        self.keep = 0
        self.dram: Payload | None = None
        self.dev: torch.Tensor | None = None
        self.wb = WB_NONE
        self.dead = False

    def tiers(self) -> frozenset[Tier]:
        return _MASK_TIERS[self.resident]

    def fastest(self) -> Tier:
        tier = _MASK_FASTEST[self.resident]
        if tier is None:
            raise AssertionError(f"{self!r} is in no tier")
        return tier


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a chunk-key chain: matched keys, the fastest tier of each, where each one's bytes
    live, and the tokens covered."""

    keys: tuple[bytes, ...]
    tiers: tuple[Tier, ...]
    locations: tuple[frozenset[Tier], ...]
    num_tokens: int

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class Lease:
    """Pins a matched prefix so nothing in it is evicted while a request uses it. ``release()`` is idempotent; also
    a context manager. ``keys``/``tiers`` (fastest tier at acquire time) are per matched chunk."""

    def __init__(self, engine: CacheEngine, nodes: list[CacheNode], tiers: tuple[Tier, ...]) -> None:
        self._engine = engine
        self._nodes: list[CacheNode] | None = nodes
        self.keys: tuple[bytes, ...] = tuple(n.key for n in nodes)
        self.tiers = tiers
        self.num_tokens = sum(n.num_tokens for n in nodes)

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def released(self) -> bool:
        return self._nodes is None

    def release(self) -> None:
        nodes, self._nodes = self._nodes, None
        if nodes:
            self._engine._unpin(nodes)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.num_chunks} chunks {self.num_tokens} tokens {state}>"


class ChunkLayerReader:
    """Reads one chunk's layers (see `CacheEngine.open_layer_reader`). ``from_ssd`` tells where they come from."""

    def __init__(self, engine: CacheEngine, node: CacheNode, mem: Payload | None, ssd_reader) -> None:
        self._engine = engine
        self._node: CacheNode | None = node
        self._mem = mem
        self._ssd = ssd_reader

    @property
    def from_ssd(self) -> bool:
        return self._ssd is not None

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor | VirtualPayload:
        if self._mem is not None:
            return self._mem[layer]
        if self._ssd is None:
            node = self._node
            return VirtualPayload(node.nbytes, node.num_layers)[layer]
        try:
            return self._ssd.read_layer(layer, out)
        except (CorruptChunkError, OSError) as exc:
            node = self._node
            with self._engine._lock:
                self._engine._drop_bad_ssd_copy(node, exc)
            raise CorruptChunkError(f"chunk {node.key.hex()} layer {layer} failed to read from SSD ({exc}); "
                                    f"dropped: recompute it") from exc

    def close(self) -> None:
        if self._ssd is not None:
            self._ssd.close()
            self._ssd = None
        node, self._node = self._node, None
        if node is not None:
            self._engine._unpin([node])

    def __enter__(self) -> ChunkLayerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completed(value: int) -> Future[int]:
    fut: Future[int] = Future()
    fut.set_result(value)
    return fut


def _resolve(futures: list[Future[None]]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


def _when_all(batch: Future[int], others: list[Future[None]]) -> Future[int]:
    """A future with ``batch``'s result that resolves once ``batch`` and every future in ``others`` are done."""
    if not others:
        return batch
    result: Future[int] = Future()
    pending = [len(others) + 1]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            pending[0] -= 1
            last = pending[0] == 0
        if last:
            exc = batch.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(batch.result())

    for fut in [batch, *others]:
        fut.add_done_callback(one_done)
    return result


class CacheEngine:
    """The PCR cache engine. Thread-safe. See the module docstring and docs/DESIGN.md for the contract."""

    def __init__(
        self, config: CacheConfig, *, clock: Clock | None = None, storage: StorageBackend | None = None
    ) -> None:
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ticks = itertools.count(1)
        self._tree = PrefixTree(self._new_node)
        self._policy = make_policy(config.policy)
        self._protected: frozenset[bytes] = frozenset()
        self._stats = CacheStats()
        self._closed = False
        self._device = torch.device(config.device) if config.has_device_tier else None
        self._budgets: dict[Tier, TierBudget] = {
            Tier.DEVICE: TierBudget(Tier.DEVICE, int(config.device_bytes) if config.has_device_tier else 0),
            Tier.DRAM: TierBudget(Tier.DRAM, int(config.dram_bytes)),
            Tier.SSD: TierBudget(Tier.SSD, int(config.ssd_bytes)),
        }
        self._orders: dict[Tier, LeafOrder] = {t: LeafOrder() for t in TIER_ORDER}
        self._leaf_orders = [(tier_bit(t), self._orders[t]) for t in TIER_ORDER]
        self._loading: dict[CacheNode, Future[None]] = {}
        self._pinned = 0  # nodes with pins > 0 (leases, loads, SSD layer reads)
        self._wb_queue: deque[CacheNode] = deque()
        self._wb_inflight = 0
        self._stop = False
        self._write_errors_logged: set[int | None] = set()
        self._write_failing = False
        self._ssd: SSDStore | None = None
        self._storage: StorageBackend | None = None
        self._open_ssd(storage)
        self._writer: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        if not config.sync_io:
            self._pool = ThreadPoolExecutor(max_workers=config.io_workers, thread_name_prefix="pcr-cache-io")
            if self._ssd is not None:
                self._writer = threading.Thread(target=self._writer_loop, name="pcr-cache-writeback", daemon=True)
                self._writer.start()

    # ================================================================== set-up
    def _open_ssd(self, storage: StorageBackend | None) -> None:
        cfg = self.config
        if int(cfg.ssd_bytes) <= 0:
            if storage is not None or cfg.cache_dir is not None:
                log.warning("ssd_bytes is 0: the SSD tier is disabled and the storage/cache_dir is not used")
            return
        if storage is None and cfg.cache_dir is None:
            log.warning("ssd_bytes > 0 but neither cache_dir nor a storage backend was given: SSD tier disabled")
            return
        try:
            backend = storage or LocalDirBackend(cfg.cache_dir, fsync=cfg.fsync, drop_page_cache=cfg.drop_page_cache)
            backend.lock()
        except CacheDirLockedError:
            raise
        except OSError as exc:
            log.error("SSD tier disabled: cannot use %s (%s); serving from DRAM only", cfg.cache_dir, exc)
            return
        self._storage = backend
        self._ssd = SSDStore(backend, pin_memory=cfg.pin_dram)
        try:
            self._recover()
        except BaseException:
            backend.unlock()
            raise

    def _recover(self) -> None:
        assert self._ssd is not None
        report = self._ssd.recover()
        self._stats.corrupt_chunks_dropped += report.corrupt
        by_parent: dict[bytes, list] = {}
        for h in report.headers:
            by_parent.setdefault(h.meta.parent, []).append(h)
        budget = self._budgets[Tier.SSD]
        added: dict[bytes, CacheNode] = {}
        frontier = [h for h in report.headers if h.meta.parent_is_root]
        with self._lock:
            while frontier:
                nxt = []
                for h in frontier:
                    m = h.meta
                    if m.key in added:
                        continue
                    node = self._tree.add(m.key, m.parent, m.parent_is_root, m.num_tokens)
                    assert isinstance(node, CacheNode)
                    node.nbytes = h.payload_nbytes
                    node.num_layers = h.shape[0]
                    node.partial = m.partial
                    node.digest = m.digest if m.digest != _ZERO_DIGEST else None
                    budget.used += h.file_bytes  # trimmed below if the directory exceeds the budget
                    self._set_resident(node, Tier.SSD)
                    added[m.key] = node
                    nxt.extend(by_parent.get(m.key, ()))
                frontier = nxt
            orphans = [h for h in report.headers if h.meta.key not in added]
            for h in orphans:
                self._ssd.delete(h.meta.key)
            self._stats.orphans_dropped += len(orphans)
            for h in report.headers:  # oldest write = least recently used
                node = added.get(h.meta.key)
                if node is not None:
                    self._touch(node)
            if budget.used > budget.capacity:
                self._evict_until(Tier.SSD, budget.used - budget.capacity)
            budget.high_water = budget.used
            self._stats.recovered_chunks = len(self._tree)
        if report.headers or report.corrupt:
            log.info(
                "SSD cache %s: recovered %d chunks, dropped %d corrupt and %d orphan files",
                self._storage.describe() if self._storage else "?",
                len(self._tree),
                report.corrupt,
                len(orphans),
            )

    # ================================================================== queries
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The active tiers, fastest first."""
        out = []
        if self._budgets[Tier.DEVICE].capacity > 0:
            out.append(Tier.DEVICE)
        out.append(Tier.DRAM)
        if self._ssd is not None:
            out.append(Tier.SSD)
        return tuple(out)

    @property
    def ssd_enabled(self) -> bool:
        return self._ssd is not None

    def __len__(self) -> int:
        return len(self._tree)

    def __contains__(self, key: object) -> bool:
        return key in self._tree

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        """Tiers holding ``key`` now (empty when not cached)."""
        with self._lock:
            node = self._tree.get(key)
            return node.tiers() if node is not None else frozenset()

    def leaf_keys(self, tier: Tier | None = None) -> list[bytes]:
        """Keys of the leaves, least recently used first: the tree's leaves (``tier=None``) or one tier's
        eviction leaves (resident there, no child resident there)."""
        with self._lock:
            if tier is None:
                nodes = sorted(self._tree.leaves, key=lambda n: (n.atime, n.tick))  # type: ignore[attr-defined]
            else:
                nodes = self._orders[Tier(tier)].ordered()
            return [n.key for n in nodes]

    @property
    def protected(self) -> frozenset[bytes]:
        return self._protected

    def match(self, keys: Sequence[bytes]) -> MatchResult:
        """Read-only walk from the root: the longest cached prefix of ``keys``; no pin, no LRU touch, no stats."""
        with self._lock:
            nodes = self._tree.match(keys)
            return MatchResult(
                keys=tuple(n.key for n in nodes),
                tiers=tuple(n.fastest() for n in nodes),
                locations=tuple(n.tiers() for n in nodes),
                num_tokens=sum(n.num_tokens for n in nodes),
            )

    def acquire(
        self,
        keys: Sequence[bytes | ChunkSpec],
        max_chunks: int | None = None,
        *,
        total_tokens: int | None = None,
    ) -> Lease:
        """Match, pin the matched nodes, LRU-touch them and count hits/misses by tier.

        ``keys`` may be chunk keys or ``ChunkSpec``s (then miss tokens are exact); with plain keys, pass
        ``total_tokens`` (tokens covered by the considered keys) to count miss tokens. ``max_chunks`` caps the
        match (and the chunks considered for hit/miss counting)."""
        raw = [k.key if isinstance(k, ChunkSpec) else k for k in keys]
        limit = len(raw) if max_chunks is None else max(0, min(len(raw), max_chunks))
        with self._lock:
            self._check_open()
            nodes = self._tree.match(raw, limit)
            tiers = tuple(_MASK_FASTEST[n.resident] for n in nodes)  # type: ignore[attr-defined]
            now = self.clock.now()
            ticks = self._ticks
            orders = self._leaf_orders
            for n in nodes:  # pin + LRU touch, root to leaf (inlined _touch: this is the hot path)
                n.pins += 1
                if n.pins == 1:
                    self._pinned += 1
                n.atime = now
                n.tick = next(ticks)
                resident = n.resident
                for bit, order in orders:
                    if resident & bit:
                        order.touched(n)
            st = self._stats
            st.lookups += 1
            hit_tokens = 0
            for n, t in zip(nodes, tiers, strict=True):
                name = t.value
                st.hit_chunks[name] += 1
                st.hit_tokens[name] += n.num_tokens
                hit_tokens += n.num_tokens
            st.miss_chunks += limit - len(nodes)
            if keys and all(isinstance(k, ChunkSpec) for k in keys[:limit]):
                st.miss_tokens += sum(k.num_tokens for k in keys[len(nodes) : limit])  # type: ignore[union-attr]
            elif total_tokens is not None:
                st.miss_tokens += max(0, total_tokens - hit_tokens)
        return Lease(self, nodes, tiers)

    def _pin(self, node: CacheNode) -> None:
        node.pins += 1
        if node.pins == 1:
            self._pinned += 1

    def _unpin(self, nodes: Iterable[CacheNode]) -> None:
        with self._lock:
            for n in nodes:
                if n.pins <= 0:
                    raise AssertionError(f"unpinning {n!r} that is not pinned")
                n.pins -= 1
                if n.pins == 0:
                    self._pinned -= 1

    def get_payload(self, key: bytes) -> Payload | None:
        """The chunk's payload when it is in device memory or DRAM (device preferred), else None. Hold a Lease
        while using it; the caller must not modify it."""
        with self._lock:
            node = self._tree.get(key)
            if node is None:
                return None
            return node.dev if node.dev is not None else node.dram

    def read_layer(self, key: bytes, layer: int) -> torch.Tensor | VirtualPayload:
        """Layer ``layer`` of a chunk, ``[2, kv_heads, tokens, head_dim]``, from the fastest tier holding it; from
        SSD only that layer is read, and verified. Raises ChunkNotFoundError when not cached and CorruptChunkError
        (after dropping the chunk) when the SSD copy fails verification."""
        with self._lock:
            node = self._tree.get(key)
            if node is None:
                raise ChunkNotFoundError(f"chunk {key.hex()} is not cached; recompute it")
            mem = node.dev if node.dev is not None else node.dram
            if mem is None:
                if node.virtual:
                    return VirtualPayload(node.nbytes, node.num_layers)[layer]
                self._pin(node)
        if mem is not None:
            return mem[layer]
        assert self._ssd is not None
        try:
            return self._ssd.read_layer(key, layer)
        except IndexError:
            raise
        except (CorruptChunkError, OSError) as exc:
            with self._lock:
                self._drop_bad_ssd_copy(node, exc)
            raise CorruptChunkError(f"chunk {key.hex()} failed to read from SSD ({exc}); dropped: recompute it") from exc
        finally:
            self._unpin([node])

    def pending_loads(self, keys: Iterable[bytes]) -> list[Future[None]]:
        """Futures of SSD -> DRAM loads in flight for any of ``keys`` (e.g. a prefetch a request can wait for
        instead of reading the same chunk from SSD a second time)."""
        with self._lock:
            out = []
            for key in keys:
                node = self._tree.get(key)
                fut = self._loading.get(node) if node is not None else None
                if fut is not None:
                    out.append(fut)
            return out

    def open_layer_reader(self, key: bytes) -> ChunkLayerReader:
        """A reader of one chunk's layers for a layer-wise load: from memory when resident (views, no copy),
        else from SSD with the file opened and its header verified once. The chunk stays pinned until the reader
        is closed. A layer that fails verification raises CorruptChunkError and the SSD copy is dropped."""
        with self._lock:
            node = self._tree.get(key)
            if node is None:
                raise ChunkNotFoundError(f"chunk {key.hex()} is not cached; recompute it")
            self._pin(node)
            mem = node.dev if node.dev is not None else node.dram
        if mem is not None or node.virtual:
            return ChunkLayerReader(self, node, mem, None)
        assert self._ssd is not None
        try:
            ssd_reader = self._ssd.open_layers(key)
        except (CorruptChunkError, OSError) as exc:
            with self._lock:
                self._drop_bad_ssd_copy(node, exc)
            self._unpin([node])
            raise CorruptChunkError(f"chunk {key.hex()} failed to open on SSD ({exc}); dropped: recompute it") from exc
        return ChunkLayerReader(self, node, None, ssd_reader)

    # ================================================================== insert
    def insert(self, spec: ChunkSpec, payload: Payload, *, tokens: Sequence[int] | None = None) -> bool:
        """Store a chunk in memory (device tier too when configured) and queue its SSD write-back.

        The parent must be the namespace root (``spec.start == 0``) or in the tree. The engine takes ownership
        of ``payload`` (do not modify it afterwards). Returns False, storing nothing, when no room can be made
        or the parent is gone. Inserting a key already cached only touches it (and brings it back into DRAM if it
        was only on SSD). ``tokens`` (the chunk's token ids) enable the supersede rule: a partial chunk keeps a
        digest of its tokens, and inserting a full chunk whose tokens start with them drops that partial leaf
        sibling (or, if it is in use, moves it to the front of the eviction order)."""
        payload = validate_payload(payload, spec.num_tokens)
        virtual = isinstance(payload, VirtualPayload)
        if tokens is not None and len(tokens) != spec.num_tokens:
            raise ValueError(f"tokens has {len(tokens)} ids but the chunk spans {spec.num_tokens} tokens")
        nbytes = int(payload.nbytes)
        mem_payload: Payload = payload
        dev_payload: torch.Tensor | None = None
        if not virtual:
            assert isinstance(payload, torch.Tensor)
            if payload.device.type != "cpu":
                mem_payload = payload.to("cpu")
            if self.config.pin_dram and not mem_payload.is_pinned():  # type: ignore[union-attr]
                mem_payload = mem_payload.pin_memory()  # type: ignore[union-attr]
            if self._device is not None:
                dev_payload = payload if payload.device == self._device else payload.to(self._device)
        digest = tokens_digest(tokens) if (tokens is not None and spec.partial) else None
        parent_is_root = spec.start == 0
        queued: CacheNode | None = None
        with self._lock:
            self._check_open()
            existing = self._tree.get(spec.key)
            if existing is not None:
                self._refresh_existing(existing, mem_payload)
                return True
            parent = None if parent_is_root else self._tree.get(spec.parent)
            if not parent_is_root and parent is None:
                self._stats.inserts_rejected += 1
                return False
            if parent is not None:
                parent.keep += 1  # keep the parent in the tree while room is made (the lock may be released)
            got_dram = got_dev = False
            try:
                got_dram = self._make_room(Tier.DRAM, nbytes)
                if dev_payload is not None:
                    got_dev = self._make_room(Tier.DEVICE, nbytes)
                existing = self._tree.get(spec.key)
                if existing is not None or (parent is not None and parent.dead) or not (got_dram or got_dev):
                    if got_dram:
                        self._budgets[Tier.DRAM].release(nbytes)
                    if got_dev:
                        self._budgets[Tier.DEVICE].release(nbytes)
                    if existing is not None:
                        self._touch(existing)
                        return True
                    self._stats.inserts_rejected += 1
                    return False
                node = self._tree.add(spec.key, spec.parent, parent_is_root, spec.num_tokens)
                assert isinstance(node, CacheNode)
                node.nbytes = nbytes
                node.num_layers = payload_num_layers(payload)
                node.partial = spec.partial
                node.virtual = virtual
                node.digest = digest
                self._touch(node)  # before residency: the leaf orders then get one fresh entry each
                if got_dram:
                    node.dram = mem_payload
                    self._set_resident(node, Tier.DRAM)
                if got_dev:
                    node.dev = dev_payload
                    self._set_resident(node, Tier.DEVICE)
                self._stats.inserts += 1
                if tokens is not None and not spec.partial:
                    self._supersede_partial_siblings(node, tokens)
                if self._ssd is not None:
                    node.wb = WB_QUEUED
                    if self.config.sync_io:
                        queued = node
                    else:
                        self._wb_queue.append(node)
                        self._cond.notify_all()
            finally:
                if parent is not None:
                    parent.keep -= 1
        if queued is not None:
            self._writeback(queued)
        return True

    def _refresh_existing(self, node: CacheNode, mem_payload: Payload) -> None:
        """Insert of a cached key: touch it; if it is only on SSD, keep the fresh copy in DRAM when it fits."""
        self._touch(node)
        if node.resident & MEM_BITS:
            return
        node.keep += 1
        try:
            if self._make_room(Tier.DRAM, node.nbytes):
                if node.dead or node.resident & DRAM_BIT:
                    self._budgets[Tier.DRAM].release(node.nbytes)
                else:
                    node.dram = mem_payload
                    self._set_resident(node, Tier.DRAM)
        finally:
            node.keep -= 1

    def _supersede_partial_siblings(self, node: CacheNode, tokens: Sequence[int]) -> None:
        siblings = node.parent.children or []
        for sib in list(siblings):
            if sib is node or not isinstance(sib, CacheNode) or not sib.partial or sib.children:
                continue
            if sib.digest is None or sib.num_tokens >= len(tokens):
                continue
            if tokens_digest(tokens[: sib.num_tokens]) != sib.digest:
                continue
            self._stats.superseded += 1
            if sib.pins == 0 and sib.keep == 0 and sib.wb != WB_WRITING:
                self._drop_everywhere(sib)
            else:  # in use: first in line for eviction once released
                sib.atime = float("-inf")
                sib.tick = next(self._ticks)
                for t in TIER_ORDER:
                    self._orders[t].touched(sib)

    # ================================================================== protection / explicit eviction
    def set_lookahead(self, keys: Iterable[bytes]) -> None:
        """Replace the protected set: the chunks the waiting window needs (evicted last under look-ahead LRU)."""
        protected = frozenset(keys)
        with self._lock:
            self._protected = protected

    def evict(self, tier: Tier, nbytes: int) -> int:
        """Evict from ``tier`` by policy until ``nbytes`` are freed or no candidate is left; returns bytes freed.
        (Tests and the simulator; inserts and loads evict on their own.)"""
        tier = Tier(tier)
        with self._lock:
            before = self._budgets[tier].used
            self._evict_until(tier, nbytes)
            return before - self._budgets[tier].used

    # ================================================================== loads
    def load(self, keys: Sequence[bytes]) -> int:
        """Bring the given chunks from SSD into DRAM now (those cached on SSD only); returns chunks loaded by this
        call. Also waits for loads of the same chunks already in flight (those count for their own caller)."""
        mine, others = self._begin_load(keys)
        loaded = self._run_loads(mine, prefetch=False) if mine else 0
        for fut in others:
            fut.result()
        return loaded

    def load_async(self, keys: Sequence[bytes]) -> Future[int]:
        """Same as ``load`` on the I/O pool (inline with ``sync_io``); the future resolves once every given chunk
        that was on SSD only is loaded (or failed), including loads already in flight. The nodes are pinned from
        this call until their load ends. Counted as prefetch loads."""
        mine, others = self._begin_load(keys)
        if self._pool is None or not mine:
            batch = _completed(self._run_loads(mine, prefetch=True) if mine else 0)
        else:
            try:
                batch = self._pool.submit(self._run_loads, mine, True)
            except RuntimeError:  # pool shut down concurrently
                self._finish_loads(mine)
                raise CacheClosedError("the cache engine is closed") from None
        return _when_all(batch, others)

    def _begin_load(self, keys: Sequence[bytes]) -> tuple[list[CacheNode], list[Future[None]]]:
        mine: list[CacheNode] = []
        others: list[Future[None]] = []
        with self._lock:
            self._check_open()
            if self._ssd is None:
                return mine, others
            seen: set[bytes] = set()
            for key in keys:
                if key in seen:
                    continue
                seen.add(key)
                node = self._tree.get(key)
                if node is None or not node.resident & SSD_BIT or node.resident & MEM_BITS:
                    continue
                fut = self._loading.get(node)
                if fut is not None:
                    others.append(fut)
                    continue
                self._pin(node)
                self._loading[node] = Future()
                mine.append(node)
        return mine, others

    def _finish_loads(self, nodes: Sequence[CacheNode]) -> None:
        """Unpin a batch of loads and resolve what is still unresolved (idempotent per node)."""
        done: list[Future[None]] = []
        with self._lock:
            for node in nodes:
                node.pins -= 1
                if node.pins == 0:
                    self._pinned -= 1
                self._load_done_locked(node, done)
        _resolve(done)

    def _load_done_locked(self, node: CacheNode, done: list[Future[None]]) -> None:
        fut = self._loading.pop(node, None)
        if fut is not None:
            done.append(fut)  # resolved by the caller after the lock is released (callbacks run inline)

    def _run_loads(self, nodes: list[CacheNode], prefetch: bool) -> int:
        """Load ``nodes`` (pinned by ``_begin_load``) in order; the whole batch stays pinned until the end, so a
        later chunk's room is never made by evicting an earlier one."""
        loaded = 0
        try:
            for node in nodes:
                done: list[Future[None]] = []
                with self._lock:
                    skip = bool(self._closed or node.dead or node.resident & MEM_BITS)
                    if not skip and not self._make_room(Tier.DRAM, node.nbytes):
                        self._stats.load_failures += 1
                        skip = True
                    if skip:
                        self._load_done_locked(node, done)
                if skip:
                    _resolve(done)
                    continue
                try:
                    if node.virtual:
                        payload: Payload = VirtualPayload(node.nbytes, node.num_layers)
                    else:
                        assert self._ssd is not None
                        payload = self._ssd.read(node.key)
                except (CorruptChunkError, OSError) as exc:
                    with self._lock:
                        self._budgets[Tier.DRAM].release(node.nbytes)
                        self._stats.load_failures += 1
                        self._drop_bad_ssd_copy(node, exc)
                        self._load_done_locked(node, done)
                    _resolve(done)
                    continue
                except BaseException:
                    with self._lock:
                        self._budgets[Tier.DRAM].release(node.nbytes)
                    raise
                with self._lock:
                    if node.dead or node.resident & DRAM_BIT:
                        self._budgets[Tier.DRAM].release(node.nbytes)
                    else:
                        node.dram = payload
                        self._set_resident(node, Tier.DRAM)
                        self._touch(node)
                        self._stats.loads += 1
                        if prefetch:
                            self._stats.prefetch_loads += 1
                        loaded += 1
                    self._load_done_locked(node, done)
                _resolve(done)
        finally:
            self._finish_loads(nodes)
        return loaded

    # ================================================================== write-back
    def _writer_loop(self) -> None:
        while True:
            with self._lock:
                while not self._wb_queue and not self._stop:
                    self._cond.wait()
                if not self._wb_queue:
                    return
                node = self._wb_queue.popleft()
                self._wb_inflight += 1
            try:
                self._writeback(node)
            except BaseException:  # never let the writer die
                log.exception("write-back of chunk %s failed unexpectedly", node.key.hex())
            finally:
                with self._lock:
                    self._wb_inflight -= 1
                    self._cond.notify_all()

    def _writeback(self, node: CacheNode) -> None:
        ssd = self._ssd
        assert ssd is not None
        budget = self._budgets[Tier.SSD]
        with self._lock:
            if node.dead or node.wb != WB_QUEUED or node.resident & SSD_BIT:
                if node.wb == WB_QUEUED:
                    node.wb = WB_NONE
                self._cond.notify_all()
                return
            src = node.dram if node.dram is not None else node.dev
            size = chunk_file_bytes(node.nbytes, 5, node.num_layers)
            node.keep += 1  # stays in the tree while room is made
            try:
                room = src is not None and self._make_room(Tier.SSD, size)
            finally:
                node.keep -= 1
            if not room or node.dead:
                if room:
                    budget.release(size)
                node.wb = WB_SKIPPED
                self._stats.writes_skipped += 1
                self._cond.notify_all()
                return
            node.wb = WB_WRITING
            meta = ChunkMeta(
                key=node.key,
                parent=node.parent.key,
                parent_is_root=node.parent.is_root,
                num_tokens=node.num_tokens,
                partial=node.partial,
                digest=node.digest or _ZERO_DIGEST,
            )
        error: BaseException | None = None
        if not node.virtual:
            try:
                assert isinstance(src, torch.Tensor)
                ssd.write(meta, src)
            except Exception as exc:  # OSError (ENOSPC, EACCES, EIO, ...) or an unstorable payload
                error = exc
        with self._lock:
            if error is not None:
                budget.release(size)
                node.wb = WB_FAILED
                self._stats.writes_failed += 1
                self._log_write_error(error)
            else:
                if self._write_failing:
                    self._write_failing = False
                    log.info("SSD write-back to %s succeeds again", self._storage.describe() if self._storage else "?")
                node.wb = WB_NONE
                if node.dead:
                    budget.release(size)
                    if not node.virtual:
                        ssd.delete(node.key)
                else:
                    self._set_resident(node, Tier.SSD)
                    self._stats.writes_done += 1
            self._cond.notify_all()

    def _log_write_error(self, exc: BaseException) -> None:
        self._write_failing = True
        code = getattr(exc, "errno", None)
        if code not in self._write_errors_logged:
            self._write_errors_logged.add(code)
            log.error(
                "SSD write-back failed (%s); chunks stay in DRAM only and failures are counted in "
                "stats().writes_failed (logged once per error kind)",
                exc,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the write-back queue is drained; raise TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._wb_queue or self._wb_inflight:
                if self._writer is None or not self._writer.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"write-back not drained after {timeout} s ({len(self._wb_queue)} queued, "
                        f"{self._wb_inflight} in flight)"
                    )
                self._cond.wait(remaining)

    def close(self) -> None:
        """Flush write-back, stop the I/O threads, release the cache directory lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
        self.flush()
        with self._lock:
            self._stop = True
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._storage is not None:
            self._storage.unlock()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache engine is closed; create a new CacheEngine")

    # ================================================================== stats / invariants
    def stats(self) -> CacheStats:
        with self._lock:
            st = CacheStats(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self._stats).items()})
            st.writeback_queue_depth = len(self._wb_queue) + self._wb_inflight
            st.pinned_chunks = self._pinned
            st.nodes = len(self._tree)
            for t, b in self._budgets.items():
                st.bytes_used[t.value] = b.used
                st.bytes_high_water[t.value] = b.high_water
                st.capacity_bytes[t.value] = b.capacity if (t != Tier.SSD or self._ssd is not None) else 0
                st.chunks[t.value] = b.chunks
            return st

    def check_invariants(self) -> None:
        """Assert every structural and accounting invariant (tests; O(nodes)). With transfers in flight the byte
        counts include reservations, so the exact byte equality is checked only when the engine is quiet."""
        with self._lock:
            self._tree.check()
            quiet = not self._wb_queue and not self._wb_inflight and not self._loading
            counts = [0, 0, 0]
            used = [0, 0, 0]
            for node in self._tree.iter_nodes():
                assert isinstance(node, CacheNode)
                assert not node.dead
                assert node.resident, f"{node!r} is in the tree but in no tier"
                for i, t in enumerate(TIER_ORDER):
                    bit = tier_bit(t)
                    res = bool(node.resident & bit)
                    if res:
                        counts[i] += 1
                        used[i] += self._tier_bytes(node, t)
                    n_child = sum(1 for c in node.children or () if c.resident & bit)  # type: ignore[attr-defined]
                    assert node.child_res[i] == n_child, f"child count of {node!r} in {t.value} is wrong"
                    is_leaf = res and n_child == 0
                    assert (node in self._orders[t]) == is_leaf, f"{t.value} leaf set wrong for {node!r}"
                assert (node.dram is not None) == bool(node.resident & DRAM_BIT)
                assert (node.dev is not None) == bool(node.resident & DEV_BIT)
                if self._ssd is not None and not node.virtual:
                    assert (node.key in self._ssd.index) == bool(node.resident & SSD_BIT)
                assert node.pins >= 0
            pinned_live = sum(1 for n in self._tree.iter_nodes() if n.pins)  # type: ignore[attr-defined]
            assert pinned_live <= self._pinned, f"pinned count {self._pinned} < {pinned_live} pinned nodes"
            for i, t in enumerate(TIER_ORDER):
                b = self._budgets[t]
                assert b.chunks == counts[i], f"{t.value} chunk count {b.chunks} != {counts[i]}"
                assert 0 <= b.used <= b.capacity, f"{t.value} over budget: {b.used} > {b.capacity}"
                assert b.high_water <= b.capacity
                assert len(self._orders[t]) == sum(
                    1
                    for n in self._tree.iter_nodes()
                    if n.resident & tier_bit(t) and not n.child_res[i]  # type: ignore[attr-defined]
                )
                if quiet:
                    assert b.used == used[i], f"{t.value} bytes used {b.used} != stored {used[i]}"

    # ================================================================== internals (lock held)
    def _new_node(self, key: bytes, parent: Node, num_tokens: int) -> CacheNode:
        node = CacheNode(key, parent, num_tokens)
        node.atime = self.clock.now()
        node.tick = next(self._ticks)  # unique from birth: LRU heap entries never tie
        return node

    def _tier_bytes(self, node: CacheNode, tier: Tier) -> int:
        if tier == Tier.SSD:
            return chunk_file_bytes(node.nbytes, 5, node.num_layers)
        return node.nbytes

    def _touch(self, node: CacheNode) -> None:
        node.atime = self.clock.now()
        node.tick = next(self._ticks)
        resident = node.resident
        if resident:
            for bit, order in self._leaf_orders:
                if resident & bit:
                    order.touched(node)

    def _set_resident(self, node: CacheNode, tier: Tier) -> None:
        bit = tier_bit(tier)
        assert not node.resident & bit
        i = tier.index
        node.resident |= bit
        self._budgets[tier].chunks += 1
        if node.child_res[i] == 0:
            self._orders[tier].add(node)
        parent = node.parent
        if not parent.is_root:
            assert isinstance(parent, CacheNode)
            parent.child_res[i] += 1
            if parent.child_res[i] == 1:
                self._orders[tier].discard(parent)

    def _clear_resident(self, node: CacheNode, tier: Tier) -> None:
        """Drop the node's copy in ``tier`` and release its bytes (the SSD file is deleted)."""
        bit = tier_bit(tier)
        assert node.resident & bit
        i = tier.index
        node.resident &= ~bit
        budget = self._budgets[tier]
        budget.chunks -= 1
        budget.release(self._tier_bytes(node, tier))
        self._orders[tier].discard(node)
        if tier == Tier.DRAM:
            node.dram = None
        elif tier == Tier.DEVICE:
            node.dev = None
        elif self._ssd is not None and not node.virtual:
            self._ssd.delete(node.key)
        parent = node.parent
        if not parent.is_root:
            assert isinstance(parent, CacheNode)
            parent.child_res[i] -= 1
            if parent.child_res[i] == 0 and parent.resident & bit:
                self._orders[tier].add(parent)

    def _remove(self, node: CacheNode) -> None:
        assert node.resident == 0 and not node.children
        self._tree.remove(node)
        node.dead = True

    def _drop_everywhere(self, node: CacheNode) -> None:
        """Remove a childless node from every tier and the tree."""
        for t in TIER_ORDER:
            if node.resident & tier_bit(t):
                self._clear_resident(node, t)
        self._remove(node)

    def _drop_bad_ssd_copy(self, node: CacheNode, exc: BaseException) -> None:
        """An SSD read of ``node`` failed verification or I/O: delete the file, count it; a node left in no tier is
        removed with its subtree (its descendants are unreachable without it)."""
        if node.dead or not node.resident & SSD_BIT:
            return
        log.warning("dropping SSD chunk %s: %s", node.key.hex(), exc)
        self._stats.corrupt_chunks_dropped += 1
        self._clear_resident(node, Tier.SSD)
        if node.resident == 0:
            for n in self._tree.subtree_postorder(node):
                assert isinstance(n, CacheNode)
                for t in TIER_ORDER:
                    if n.resident & tier_bit(t):
                        self._clear_resident(n, t)
                self._remove(n)

    def _evictable(self, node: CacheNode, tier: Tier) -> bool | str:
        if node.pins:
            return False
        bit = tier_bit(tier)
        # not on SSD yet: a memory copy goes only if the write-back cannot need it any more
        writing = node.wb == WB_WRITING or (node.wb == WB_QUEUED and not node.resident & MEM_BITS & ~bit)
        if tier != Tier.SSD and not node.resident & SSD_BIT and writing:
            return _PENDING
        if node.resident & ~bit:
            return True  # a copy stays elsewhere: the tree does not change
        # dropping the last copy removes the node from the tree: only for childless, unheld nodes
        return not node.children and not node.keep

    def _evict_one(self, node: CacheNode, tier: Tier) -> None:
        slower = sum(tier_bit(t) for t in TIER_ORDER[tier.index + 1 :])
        self._clear_resident(node, tier)
        self._stats.evictions[tier.value] += 1
        if node.resident & slower:
            self._stats.demotions[tier.value] += 1
        if node.resident == 0:
            self._remove(node)

    def _evict_until(self, tier: Tier, nbytes: int) -> bool:
        """Evict by policy until ``nbytes`` have been freed from ``tier`` (no waiting); True when they were."""
        ok, _ = self._evict_pass(tier, target_free=None, to_free=nbytes)
        return ok

    def _evict_pass(self, tier: Tier, *, target_free: int | None, to_free: int = 0) -> tuple[bool, bool]:
        budget = self._budgets[tier]
        start_used = budget.used

        def done() -> bool:
            if target_free is not None:
                return budget.free >= target_free
            return start_used - budget.used >= to_free

        if done():
            return True, False
        pending = False
        gen = self._policy.candidates(self._orders[tier], self._protected)
        try:
            for node in gen:
                verdict = self._evictable(node, tier)
                if verdict is _PENDING:
                    pending = True
                    continue
                if not verdict:
                    continue
                self._evict_one(node, tier)
                if done():
                    return True, pending
        finally:
            gen.close()
        if tier != Tier.SSD:
            self._demote_interior(tier, done)
        return done(), pending

    def _demote_interior(self, tier: Tier, done: Callable[[], bool]) -> None:
        """Fallback when no leaf of a memory tier can go (e.g. a long chain fills DRAM and its only leaf is the
        pinned parent of the chunk being inserted): drop memory copies of non-leaf nodes that also live in a slower
        tier, least recent first (unprotected first under look-ahead). The tree does not change (pure demotion).
        O(nodes log nodes), so it runs only after the leaf pass failed."""
        bit = tier_bit(tier)
        slower = sum(tier_bit(t) for t in TIER_ORDER[tier.index + 1 :])
        protected = self._protected if self._policy.uses_lookahead else frozenset()
        candidates = [
            n
            for n in self._tree.iter_nodes()
            if n.resident & bit and n.resident & slower and not n.pins  # type: ignore[attr-defined]
        ]
        candidates.sort(key=lambda n: (n.key in protected, n.atime, n.tick))  # type: ignore[attr-defined]
        for node in candidates:
            assert isinstance(node, CacheNode)
            if node.resident & bit and node.resident & slower and not node.pins:
                self._evict_one(node, tier)
                if done():
                    return

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        """Reserve ``nbytes`` in ``tier``, evicting by policy as needed. May release the lock while waiting for
        pending write-backs (memory tiers); callers pin what they need kept and re-check state afterwards."""
        budget = self._budgets[tier]
        if nbytes > budget.capacity:
            return False
        deadline: float | None = None
        while True:
            if budget.free >= nbytes:
                return budget.reserve(nbytes)
            ok, pending = self._evict_pass(tier, target_free=nbytes)
            if ok:
                return budget.reserve(nbytes)
            if not pending or self._closed:
                return False
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.config.writeback_wait_s
            if now >= deadline:
                log.warning(
                    "%s full of chunks whose SSD write-back is still pending after %.1f s; request not cached",
                    tier.value,
                    self.config.writeback_wait_s,
                )
                return False
            self._cond.wait(min(deadline - now, 0.1))
