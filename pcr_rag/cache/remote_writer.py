"""Write-through to the remote tier: every new chunk, once it has landed locally, is written to the shared store
by a background thread, so other replicas can reuse it.

- Bounded: at most ``capacity`` chunks wait (each holds a reference to its payload, nothing is copied at offer
  time). A full queue, or an open circuit breaker, drops the write and counts it (``writes_dropped``): a request
  never waits for the remote store.
- ``SET NX``: a value another replica already wrote for the key is left as it is (``writes_existing``).
- A value is sealed under its chain's namespace root, found from the tree when the chunk is offered (its own node
  or its parent's); a chunk whose chain is no longer in the tree is dropped (``writes_dropped``).
- Once written, the node (if still cached) is marked resident in the remote tier, within the tier's budget, so it
  outlives its local copies there. A failed write only counts (``writes_failed``, and the client's ``errors``).
- ``inline`` (``sync_io``): the offering thread writes at once (deterministic; the simulator).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from pcr_rag.cache.background import lower_this_thread_priority
from pcr_rag.cache.errors import RemoteError
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.payload import Payload
from pcr_rag.cache.residency import ResidencyIndex, Room
from pcr_rag.cache.tiers.base import ChunkRecord, Tier, tier_bit
from pcr_rag.cache.tiers.remote import RemoteTier, root_of

__all__ = ["RemoteWriter"]

log = logging.getLogger(__name__)

_BIT = tier_bit(Tier.REMOTE)


class RemoteWriter:
    """The remote write-through queue and thread of one engine (see the module docstring)."""

    def __init__(self, sync: CacheLock, index: ResidencyIndex, tier: RemoteTier, *, capacity: int,
                 inline: bool) -> None:
        self.tier = tier
        self.capacity = capacity
        self._sync = sync
        self._index = index
        self._cond = threading.Condition()
        self._queue: deque[tuple[ChunkRecord, Payload, bytes]] = deque()
        self._writing = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="pcr-cache-remote-writer", daemon=True)
            self._thread.start()

    @property
    def depth(self) -> int:
        """Chunks queued or being written now."""
        with self._cond:
            return len(self._queue) + self._writing

    def offer(self, chunk: ChunkRecord, payload: Payload) -> None:
        """Queue ``chunk`` for the remote store (no engine lock held); drops it (counted) when the queue is full or
        the store is being skipped."""
        client = self.tier.client
        if not client.available():
            client.count("writes_dropped")
            return
        root = self._root(chunk)
        if root is None:
            client.count("writes_dropped")
            return
        if self._thread is None:
            self.write(chunk, payload, root)
            return
        with self._cond:
            if len(self._queue) >= self.capacity or self._stopping:
                client.count("writes_dropped")
                return
            self._queue.append((chunk, payload, root))
            self._cond.notify_all()

    def _root(self, chunk: ChunkRecord) -> bytes | None:
        """The namespace root of ``chunk``'s chain (None when neither it nor its parent is in the tree)."""
        if chunk.parent_is_root:
            return chunk.parent_key
        with self._sync.lock:
            node = self._index.get(chunk.key) or self._index.get(chunk.parent_key)
            return root_of(node) if node is not None else None

    def write(self, chunk: ChunkRecord, payload: Payload, root: bytes) -> None:
        """Write one chunk (of namespace root ``root``) now and record where it lives (no lock held)."""
        tier, index = self.tier, self._index
        size = tier.charge(chunk)
        with self._sync.lock:
            node = index.get(chunk.key)
            if node is not None and node.resident_mask & _BIT:
                return  # the tree already knows the store holds it
            reserved = False
            if node is not None:
                node.tree_holds += 1  # stays in the tree while room is made
                try:
                    reserved = index.make_room(Tier.REMOTE, size) is Room.RESERVED
                finally:
                    node.tree_holds -= 1
        try:
            tier.store(chunk, payload, root)
        except RemoteError:
            tier.client.count("writes_failed")
            if reserved:
                with self._sync.lock:
                    index.release(Tier.REMOTE, size)
            return
        except Exception:  # an unstorable payload: never raise into the writer or a request
            log.exception("remote write of chunk %s failed", chunk.key.hex())
            tier.client.count("writes_failed")
            if reserved:
                with self._sync.lock:
                    index.release(Tier.REMOTE, size)
            return
        with self._sync.lock:
            live = index.get(chunk.key)
            if reserved and node is live and node is not None and not node.resident_mask & _BIT:
                index.mark_resident(node, Tier.REMOTE)
                return
            if reserved:
                index.release(Tier.REMOTE, size)
            if live is None or not live.resident_mask & _BIT:
                tier.drop(chunk)  # written, but not tracked in the tree

    def _run(self) -> None:
        lower_this_thread_priority()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                chunk, payload, root = self._queue.popleft()
                self._writing += 1
            try:
                if self.tier.client.available():
                    self.write(chunk, payload, root)
                else:
                    self.tier.client.count("writes_dropped")
            except BaseException:  # never let the writer die
                log.exception("remote write of chunk %s failed unexpectedly", chunk.key.hex())
            finally:
                with self._cond:
                    self._writing -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write is done (or dropped); ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._writing:
                if self._thread is None or not self._thread.is_alive():
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"remote writes not drained after {timeout} s ({len(self._queue)} queued)")
                self._cond.wait(remaining)

    def stop(self) -> None:
        """Stop the writer once the queue is drained; waits for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
