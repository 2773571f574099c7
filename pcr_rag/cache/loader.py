"""Reads: chunks read in place (``get_payload``, ``read_layer``, layer readers) and loads (storage -> DRAM
copies, in flight at most once per chunk, on an I/O pool), all through the one verified-read helper.

- ``read_verified`` runs a read of a tier's copy, timed (``on_read(tier, bytes, seconds)``: the load-or-recompute
  planner's read speeds, ``cache.reuse_planner``); when it fails (``CorruptChunkError``, or an ``OSError`` such
  as a missing file or a timeout) the copy is dropped (a node left in no tier goes with its subtree), counted in
  ``corrupt_chunks_dropped``, and ``CorruptChunkError`` says to recompute.
- A load pins its nodes from ``begin`` until the batch ends, so a later chunk's room is never made by evicting
  an earlier one, and a node is never loaded twice at once: a second caller gets the first one's future.
- Loads read from the fastest storage tier holding the chunk and land in DRAM (room made by policy; a load that
  gets none counts in ``load_failures`` and the chunk stays where it is). A chunk loaded from the shared remote
  tier is queued for write-back to the local SSD too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from pcr_rag.cache.errors import CacheClosedError, ChunkNotFoundError, CorruptChunkError
from pcr_rag.cache.lease import ChunkLayerReader
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.node import CacheNode, WriteBackState, fastest_tier
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.residency import ResidencyIndex
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.tiers.base import LayerSource, PayloadLayers, Tier, TierKind, tier_bit
from pcr_rag.cache.writeback import WriteBack

__all__ = ["Loader"]

T = TypeVar("T")


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


class Loader:
    """Loads into DRAM for one engine (see the module docstring). ``workers`` None runs loads inline."""

    def __init__(
        self,
        sync: CacheLock,
        index: ResidencyIndex,
        writeback: WriteBack,
        stats: CacheStats,
        *,
        workers: int | None,
        on_read: Callable[[Tier, int, float], None] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._sync = sync
        self._on_read = on_read
        self._timer = timer
        self._index = index
        self._writeback = writeback
        self._stats = stats
        self._dram = index.tiers[Tier.DRAM]
        self._dram_bit = tier_bit(Tier.DRAM)
        self._memory = [t for t in index.tiers.values() if t.kind is TierKind.MEMORY]  # fastest first
        self._memory_bits = sum(tier_bit(t.tier) for t in self._memory)
        self._storage_bits = sum(tier_bit(t) for t, s in index.tiers.items() if s.kind is TierKind.STORAGE)
        self._loading: dict[CacheNode, Future[None]] = {}
        self._pool = (
            None if workers is None else ThreadPoolExecutor(workers, thread_name_prefix="pcr-cache-io")
        )

    def loading(self, node: CacheNode) -> bool:
        """A load of ``node`` is in flight (lock held)."""
        return node in self._loading

    @property
    def idle(self) -> bool:
        """No load in flight (lock held)."""
        return not self._loading

    def read_verified(self, node: CacheNode, tier: Tier, read: Callable[[], T]) -> T:
        """``read()`` of ``tier``'s copy of ``node`` (no lock held; the caller keeps ``node`` pinned). A failed read
        drops that copy and raises ``CorruptChunkError``. A read that returns bytes is timed for ``on_read``."""
        try:
            t0 = self._timer()
            out = read()
            if self._on_read is not None:
                nbytes = getattr(out, "nbytes", 0)
                if nbytes:
                    self._on_read(tier, int(nbytes), self._timer() - t0)
            return out
        except (CorruptChunkError, OSError) as exc:  # OSError covers missing files and timeouts
            with self._sync.lock:
                self._index.drop_bad_copy(node, tier, exc)
            raise CorruptChunkError(
                f"chunk {node.key.hex()} failed to read from {tier.value} ({exc}); dropped: recompute it"
            ) from exc

    # ------------------------------------------------------------------ reads in place
    def release(self, nodes: list[CacheNode]) -> None:
        """Unpin what a lease or reader held."""
        with self._sync.lock:
            self._index.unpin(nodes)

    def _memory_copy(self, node: CacheNode) -> tuple[Tier, Payload] | None:
        """The fastest memory copy of ``node`` (lock held)."""
        if node.resident_mask & self._memory_bits:
            for tier in self._memory:
                copy = tier.get(node)
                if copy is not None:
                    return tier.tier, copy
        return None

    def _pin_for_read(self, key: bytes) -> tuple[CacheNode, Tier, Payload | None]:
        """Pin the node of ``key`` and say where to read it: a memory copy, or the fastest tier holding it."""
        with self._sync.lock:
            node = self._index.get(key)
            if node is None:
                raise ChunkNotFoundError(f"chunk {key.hex()} is not cached; recompute it")
            self._index.pin(node)
            found = self._memory_copy(node)
            return (node, *found) if found is not None else (node, node.fastest(), None)

    def get_payload(self, key: bytes) -> Payload | None:
        with self._sync.lock:
            node = self._index.get(key)
            found = self._memory_copy(node) if node is not None else None
            return found[1] if found is not None else None

    def read_layer(self, key: bytes, layer: int) -> torch.Tensor | VirtualPayload:
        node, tier, copy = self._pin_for_read(key)
        try:
            if copy is not None:
                return copy[layer]
            store = self._index.tiers[tier]
            return self.read_verified(node, tier, lambda: store.read_layer(node, layer))
        finally:
            self.release([node])

    def open_layer_reader(self, key: bytes) -> ChunkLayerReader:
        node, tier, copy = self._pin_for_read(key)
        try:
            if copy is not None:
                source: LayerSource = PayloadLayers(copy)
            else:
                store = self._index.tiers[tier]
                source = self.read_verified(node, tier, lambda: store.open_layers(node))
        except BaseException:
            self.release([node])
            raise
        return ChunkLayerReader(node, tier, source, self.read_verified, self.release)

    # ------------------------------------------------------------------ loads into DRAM
    def pending(self, keys: Iterable[bytes]) -> list[Future[None]]:
        """Futures of loads in flight for any of ``keys``."""
        with self._sync.lock:
            out = []
            for key in keys:
                node = self._index.get(key)
                fut = self._loading.get(node) if node is not None else None
                if fut is not None:
                    out.append(fut)
            return out

    def load(self, keys: Sequence[bytes]) -> int:
        """Load now; returns chunks loaded by this call (also waits for loads of the same chunks in flight)."""
        mine, others = self._begin(keys)
        loaded = self._run(mine, prefetch=False) if mine else 0
        for fut in others:
            fut.result()
        return loaded

    def load_async(self, keys: Sequence[bytes]) -> Future[int]:
        """``load`` on the I/O pool (inline without one), counted as prefetch loads."""
        mine, others = self._begin(keys)
        if self._pool is None or not mine:
            batch = _completed(self._run(mine, prefetch=True) if mine else 0)
        else:
            try:
                batch = self._pool.submit(self._run, mine, True)
            except RuntimeError:  # pool shut down concurrently
                self._finish(mine)
                raise CacheClosedError("the cache engine is closed") from None
        return _when_all(batch, others)

    def _begin(self, keys: Sequence[bytes]) -> tuple[list[CacheNode], list[Future[None]]]:
        mine: list[CacheNode] = []
        others: list[Future[None]] = []
        with self._sync.lock:
            self._sync.check_open()
            seen: set[bytes] = set()
            for key in keys:
                if key in seen:
                    continue
                seen.add(key)
                node = self._index.get(key)
                if (
                    node is None
                    or not node.resident_mask & self._storage_bits
                    or node.resident_mask & self._memory_bits
                ):
                    continue
                fut = self._loading.get(node)
                if fut is not None:
                    others.append(fut)
                    continue
                self._index.pin(node)
                self._loading[node] = Future()
                mine.append(node)
        return mine, others

    def _finish(self, nodes: Sequence[CacheNode]) -> None:
        """Unpin a batch and resolve what is still unresolved (idempotent per node)."""
        done: list[Future[None]] = []
        with self._sync.lock:
            self._index.unpin(nodes)
            for node in nodes:
                self._done_locked(node, done)
        _resolve(done)

    def _done_locked(self, node: CacheNode, done: list[Future[None]]) -> None:
        fut = self._loading.pop(node, None)
        if fut is not None:
            done.append(fut)  # resolved by the caller after the lock is released (callbacks run inline)

    def _run(self, nodes: list[CacheNode], prefetch: bool) -> int:
        """Load ``nodes`` (pinned by ``_begin``) in order."""
        loaded = 0
        index = self._index
        try:
            for node in nodes:
                done: list[Future[None]] = []
                with self._sync.lock:
                    source = fastest_tier(node.resident_mask & self._storage_bits)
                    skip = (
                        self._sync.closed
                        or node.removed
                        or source is None
                        or bool(node.resident_mask & self._memory_bits)
                    )
                    if not skip and not self._writeback.make_room(Tier.DRAM, self._dram.charge(node), node.tenant):
                        self._stats.load_failures += 1
                        skip = True
                    if skip:
                        self._done_locked(node, done)
                if skip:
                    _resolve(done)
                    continue
                assert source is not None
                store = index.tiers[source]
                try:
                    payload = self._dram.place(self.read_verified(node, source, lambda: store.read(node)))  # noqa: B023
                except CorruptChunkError:
                    with self._sync.lock:
                        index.release(Tier.DRAM, self._dram.charge(node), node.tenant)
                        self._stats.load_failures += 1
                        self._done_locked(node, done)
                    _resolve(done)
                    continue
                except BaseException:
                    with self._sync.lock:
                        index.release(Tier.DRAM, self._dram.charge(node), node.tenant)
                    raise
                write_back = False
                with self._sync.lock:
                    if node.removed or node.resident_mask & self._dram_bit:
                        index.release(Tier.DRAM, self._dram.charge(node), node.tenant)
                    else:
                        self._dram.store(node, payload)
                        index.mark_resident(node, Tier.DRAM)
                        index.touch(node)
                        self._stats.loads += 1
                        if prefetch:
                            self._stats.prefetch_loads += 1
                        loaded += 1
                        write_back = self._to_local_storage(node)
                    self._done_locked(node, done)
                if write_back:
                    self._writeback.write(node)
                _resolve(done)
        finally:
            self._finish(nodes)
        return loaded

    def _to_local_storage(self, node: CacheNode) -> bool:
        """A chunk loaded from the shared remote tier also goes to the local SSD (write-back queued; lock held).
        True: the caller writes it now (inline mode)."""
        target = self._writeback.target
        if target is None or node.resident_mask & tier_bit(target.tier) or node.writeback in (
                WriteBackState.QUEUED, WriteBackState.WRITING):
            return False
        return self._writeback.enqueue(node)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
