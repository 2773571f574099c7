"""``CacheLock``: the one lock of a cache engine, shared by its parts (residency, write-back, loads, readers).

Holding it gives exclusive access to all metadata: the prefix tree, residency, budgets, pins, queues and stats.
``cond`` (on the same lock) is notified whenever write-back makes progress, so inserts and loads waiting for room
or ``flush`` can re-check. ``closed`` is set once, by ``CacheManager.close``.
"""

from __future__ import annotations

import threading

from pcr_rag.cache.errors import CacheClosedError

__all__ = ["CacheLock"]


class CacheLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.closed = False

    def check_open(self) -> None:
        """Raise ``CacheClosedError`` once the engine is closed (call with the lock held)."""
        if self.closed:
            raise CacheClosedError("the cache engine is closed; create a new CacheManager")
