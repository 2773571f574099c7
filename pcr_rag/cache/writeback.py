"""Write-back: copies of memory chunks to the storage tier, so they survive DRAM eviction and restarts.

- Every chunk inserted into memory is queued (FIFO) and written by one background thread, or inline by the
  inserting thread with ``sync_io``. The storage bytes are reserved before the write and the node is kept in the
  tree while room is made; a chunk being written keeps its memory copy (``Evictability.AFTER_WRITEBACK``), so a
  load and a write of one chunk never race. I/O runs outside the engine lock.
- Failures never raise into a request: an I/O error (ENOSPC, EACCES, ...) leaves the chunk in memory only
  (``writes_failed``, logged once per errno); no storage room leaves it there too (``writes_skipped``).
- ``make_room`` is the residency index's, plus backpressure: when the only candidates are memory copies still
  waiting for their write, the caller waits up to ``wait_s`` for the writer instead of losing them.
- Write-through: a chunk that gets no memory room at all (e.g. DRAM full of chunks pinned by running requests) is
  written straight to storage by the inserting thread (``reserve_through`` + ``write_through``), so a small DRAM
  never switches caching off; its key is in ``writing_through`` meanwhile, and ``flush`` waits for it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from pcr_rag.cache.background import lower_this_thread_priority
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.node import CacheNode, WriteBackState
from pcr_rag.cache.payload import Payload
from pcr_rag.cache.residency import ResidencyIndex, Room
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.tiers.base import UNATTRIBUTED, ChunkRecord, KVTier, Tier, TierKind, tier_bit

__all__ = ["WriteBack"]

log = logging.getLogger(__name__)


class WriteBack:
    """The write-back queue and thread of one engine (see the module docstring). ``target`` is the storage tier
    written to (None: no storage tier, nothing is queued)."""

    def __init__(
        self,
        sync: CacheLock,
        index: ResidencyIndex,
        target: KVTier | None,
        stats: CacheStats,
        *,
        inline: bool,
        wait_s: float,
    ) -> None:
        self.target = target
        self.writing_through: set[bytes] = set()
        self._sync = sync
        self._index = index
        self._stats = stats
        self._wait_s = wait_s
        self._queue: deque[CacheNode] = deque()
        self._in_flight = 0
        self._stopping = False
        self._errors_logged: set[int | None] = set()
        self._failing = False
        # host copies first: the write needs CPU bytes
        memory = [t for t in index.tiers.values() if t.kind is TierKind.MEMORY]
        self._sources = sorted(memory, key=lambda t: t.tier is not Tier.DRAM)
        self._memory_bits = sum(tier_bit(t.tier) for t in memory)
        self._thread: threading.Thread | None = None
        if target is not None and not inline:
            self._thread = threading.Thread(target=self._run, name="pcr-cache-writeback", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ lock held
    @property
    def depth(self) -> int:
        """Chunks queued or being written now."""
        return len(self._queue) + self._in_flight

    @property
    def idle(self) -> bool:
        return not self._queue and not self._in_flight and not self.writing_through

    def enqueue(self, node: CacheNode) -> bool:
        """Queue ``node``'s write-back; True when the caller must run ``write(node)`` itself after releasing the
        lock (inline mode)."""
        node.writeback = WriteBackState.QUEUED
        if self._thread is None:
            return True
        self._queue.append(node)
        self._sync.cond.notify_all()
        return False

    def make_room(self, tier: Tier, nbytes: int, tenant: bytes = UNATTRIBUTED) -> bool:
        """Reserve ``nbytes`` in ``tier`` for ``tenant`` (``ResidencyIndex.make_room``), waiting up to ``wait_s``
        for pending write-backs when only they stand in the way. The lock is released while waiting: callers hold
        what they need (pin, tree hold) and re-check state afterwards."""
        deadline: float | None = None
        while True:
            room = self._index.make_room(tier, nbytes, tenant)
            if room is not Room.AFTER_WRITEBACK or self._stopping:
                return room is Room.RESERVED
            now = time.monotonic()
            if deadline is None:
                deadline = now + self._wait_s
            if now >= deadline:
                log.warning(
                    "%s full of chunks whose write-back is still pending after %.1f s",
                    tier.value,
                    self._wait_s,
                )
                return False
            self._sync.cond.wait(min(deadline - now, 0.1))

    def _record_error(self, exc: BaseException) -> None:
        self._stats.writes_failed += 1
        self._failing = True
        code = getattr(exc, "errno", None)
        if code not in self._errors_logged:
            self._errors_logged.add(code)
            log.error(
                "%s write-back failed (%s); chunks stay in memory only and failures are counted in "
                "stats().writes_failed (logged once per error kind)",
                self.target.tier.value if self.target else "storage",
                exc,
            )

    def _record_success(self) -> None:
        if self._failing:
            self._failing = False
            log.info("write-back to %s succeeds again", self.target.describe() if self.target else "?")

    # ------------------------------------------------------------------ no lock held
    def _source(self, node: CacheNode) -> Payload | None:
        for tier in self._sources:
            copy = tier.get(node)
            if copy is not None:
                return copy
        return None

    def write(self, node: CacheNode) -> None:
        """Write ``node``'s memory copy to the target tier (a queued node; anything else is a no-op)."""
        target = self.target
        assert target is not None
        index = self._index
        cond = self._sync.cond
        with self._sync.lock:
            if (
                node.removed
                or node.writeback is not WriteBackState.QUEUED
                or node.resident_mask & tier_bit(target.tier)
            ):
                if node.writeback is WriteBackState.QUEUED:
                    node.writeback = WriteBackState.NOT_NEEDED
                cond.notify_all()
                return
            src = self._source(node)
            size = target.charge(node)
            node.tree_holds += 1  # stays in the tree while room is made
            try:
                room = src is not None and index.make_room(target.tier, size, node.tenant) is Room.RESERVED
            finally:
                node.tree_holds -= 1
            if not room or node.removed:
                if room:
                    index.release(target.tier, size, node.tenant)
                node.writeback = WriteBackState.SKIPPED
                self._stats.writes_skipped += 1
                cond.notify_all()
                return
            node.writeback = WriteBackState.WRITING
        error: BaseException | None = None
        try:
            target.store(node, src)
        except Exception as exc:  # OSError (ENOSPC, EACCES, EIO, ...) or an unstorable payload
            error = exc
        with self._sync.lock:
            if error is not None:
                index.release(target.tier, size, node.tenant)
                node.writeback = WriteBackState.FAILED
                self._record_error(error)
            else:
                self._record_success()
                node.writeback = WriteBackState.NOT_NEEDED
                if node.removed:
                    index.release(target.tier, size, node.tenant)
                    target.drop(node)
                else:
                    index.mark_resident(node, target.tier)
                    self._stats.writes_done += 1
            cond.notify_all()

    def refresh(self, node: CacheNode, dram_copy: Payload) -> bool:
        """An insert of a cached key (lock held): touch it; if only storage holds it, keep the fresh copy in DRAM
        when it fits, and queue its write-back when the local storage has no copy (e.g. one the remote store
        served). True: the caller must run ``write(node)`` after releasing the lock (inline mode)."""
        index = self._index
        index.touch(node)
        if node.resident_mask & self._memory_bits:
            return False
        node.tree_holds += 1
        try:
            dram = index.tiers[Tier.DRAM]
            if self.make_room(Tier.DRAM, dram.charge(node), node.tenant):
                if node.removed or node.resident_mask & tier_bit(Tier.DRAM):
                    index.release(Tier.DRAM, dram.charge(node), node.tenant)
                    return False
                dram.store(node, dram_copy)
                index.mark_resident(node, Tier.DRAM)
                target = self.target
                if target is not None and not node.resident_mask & tier_bit(target.tier) and node.writeback not in (
                        WriteBackState.QUEUED, WriteBackState.WRITING):
                    return self.enqueue(node)
        finally:
            node.tree_holds -= 1
        return False

    def reserve_through(self, chunk: ChunkRecord) -> bool:
        """Reserve storage room for a chunk no memory tier could take (lock held); its key is then in
        ``writing_through`` until ``write_through`` ends."""
        target = self.target
        if target is None or self._index.make_room(target.tier, target.charge(chunk),
                                                   chunk.tenant) is not Room.RESERVED:
            return False
        self.writing_through.add(chunk.key)
        return True

    def write_through(
        self, chunk: ChunkRecord, payload: Payload, parent: CacheNode | None, tokens: Sequence[int] | None
    ) -> bool:
        """Write a chunk reserved by ``reserve_through`` straight to storage (no lock held), then add its node
        there. Releases ``parent``'s tree hold (taken by the caller). False, counted as a rejected insert, when
        the write fails (counted and logged like a write-back) or the parent left the tree meanwhile."""
        target = self.target
        assert target is not None
        error: BaseException | None = None
        try:
            target.store(chunk, target.place(payload))
        except Exception as exc:  # as in write(): any failure is a counted miss, never raised
            error = exc
        with self._sync.lock:
            self.writing_through.discard(chunk.key)
            self._sync.cond.notify_all()
            if parent is not None:
                parent.tree_holds -= 1
            if error is not None:
                self._record_error(error)
            else:
                self._record_success()
            if error is not None or (parent is not None and parent.removed):
                self._index.release(target.tier, target.charge(chunk), chunk.tenant)
                if error is None:
                    target.drop(chunk)
                self._stats.inserts_rejected += 1
                return False
            node = self._index.add_node(chunk)
            self._index.mark_resident(node, target.tier)
            self._stats.write_through += 1
            self._index.inserted(node, tokens)
        return True

    def _run(self) -> None:
        cond = self._sync.cond
        lower_this_thread_priority()
        while True:
            with self._sync.lock:
                while not self._queue and not self._stopping:
                    cond.wait()
                if not self._queue:
                    return
                node = self._queue.popleft()
                self._in_flight += 1
            try:
                self.write(node)
            except BaseException:  # never let the writer die
                log.exception("write-back of chunk %s failed unexpectedly", node.key.hex())
            finally:
                with self._sync.lock:
                    self._in_flight -= 1
                    cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the queue is drained and no write-through is in flight; TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._sync.lock:
            while True:
                writer_alive = self._thread is not None and self._thread.is_alive()
                if not ((self._queue and writer_alive) or self._in_flight or self.writing_through):
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"write-back not drained after {timeout} s ({len(self._queue)} queued, "
                        f"{self._in_flight} in flight, {len(self.writing_through)} written through)"
                    )
                self._sync.cond.wait(remaining)

    def stop(self) -> None:
        """Stop the writer after the queue is drained (call ``flush`` first); waits for it to end."""
        with self._sync.lock:
            self._stopping = True
            self._sync.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
