"""Queue-based prefetch: a look-ahead window over the waiting queue (and announced requests).

`plan_prefetch` is the decision, a pure function of the window and the cache state, shared by the runtime's
`Prefetcher` thread and the simulator: every chunk a windowed request needs is protected from eviction
(look-ahead LRU), and the matched-prefix chunks that sit on SSD or in the remote store but not in memory are
loaded into DRAM while the requests wait, as far as loading beats recomputing (`CacheManager.reuse_limit`: the
load-or-recompute planner). With a remote tier, each request entering the window is first looked up there
(`CacheManager.discover`). After each cycle the window slides with the queue.

The window is a value the scheduler hands out (`Scheduler.prefetch_window`, a `lookahead.PrefetchWindow`): the
prefetcher reads it from its ``source`` each cycle and never calls into the engine's facade.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from pcr_rag.cache import CacheManager, Tier
from pcr_rag.sched.lookahead import PrefetchWindow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchPlan:
    """protect: every chunk key in the window. load: keys to bring SSD/remote -> DRAM, in queue order, no
    duplicates."""

    protect: frozenset[bytes]
    load: tuple[bytes, ...]


def plan_prefetch(window: Sequence[Sequence[bytes]], cache: CacheManager) -> PrefetchPlan:
    """Decide what to protect and what to load for the next requests (``window``: chunk keys per request)."""
    protect: set[bytes] = set()
    load: list[bytes] = []
    seen: set[bytes] = set()
    for keys in window:
        protect.update(keys)
        match = cache.match(keys)
        usable = cache.reuse_limit(keys)
        for key, tier in zip(match.keys[:usable], match.tiers[:usable]):
            if (tier is Tier.SSD or tier is Tier.REMOTE) and key not in seen:
                seen.add(key)
                load.append(key)
    return PrefetchPlan(frozenset(protect), tuple(load))


class WindowSource(Protocol):
    """Where the window comes from (`pcr_rag.sched.scheduler.Scheduler`)."""

    def prefetch_window(self, limit: int) -> PrefetchWindow: ...


class Prefetcher:
    """Background thread: each cycle takes the window, protects its chunks and starts SSD -> DRAM loads.

    ``source.prefetch_window(window)`` gives the chunk keys of the next requests in the order they will run
    (`PrefetchWindow`). ``wake()`` runs a cycle soon (the scheduler calls it when the queue changes: `Scheduler.watch`;
    the engine when the announcement board does); otherwise a cycle runs every ``interval_s`` seconds.
    """

    def __init__(self, cache: CacheManager, source: WindowSource,
                 *, window: int, do_loads: bool, protect: bool, interval_s: float = 0.05,
                 on_cycle: Callable[[], None] | None = None) -> None:
        self.cache = cache
        self.source = source
        self.window = window
        self.do_loads = do_loads
        self.protect = protect
        self.interval_s = interval_s
        self.on_cycle = on_cycle
        self._cond = threading.Condition()
        self._dirty = True
        self._stop = False
        self._inflight: dict[bytes, Future] = {}
        self._looked_up: set[bytes] = set()  # last chunk key of each windowed request already looked up remotely
        self.cycles = 0
        self.loads_started = 0
        self.last_window = PrefetchWindow()  # the window of the latest cycle
        self._thread = threading.Thread(target=self._loop, name="pcr-prefetch", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def run_cycle(self) -> PrefetchPlan:
        self.last_window = self.source.prefetch_window(self.window) if self.window > 0 else PrefetchWindow()
        window = self.last_window.chains
        if self.cache.remote_enabled and self.do_loads:  # look each request up once while it is in the window
            ends = {keys[-1] for keys in window if keys}
            for keys in window:
                if keys and keys[-1] not in self._looked_up:
                    self.cache.discover(keys)
            self._looked_up = ends
        plan = plan_prefetch(window, self.cache)
        if self.protect:
            self.cache.set_lookahead(plan.protect)
        if self.do_loads:
            self._inflight = {k: f for k, f in self._inflight.items() if not f.done()}
            todo = [k for k in plan.load if k not in self._inflight]
            if todo:
                fut = self.cache.load_async(todo)
                fut.add_done_callback(_log_failure)
                for k in todo:
                    self._inflight[k] = fut
                self.loads_started += len(todo)
        self.cycles += 1
        if self.on_cycle is not None:
            self.on_cycle()
        return plan

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._dirty and not self._stop:
                    self._cond.wait(self.interval_s)
                if self._stop:
                    return
                self._dirty = False
            try:
                self.run_cycle()
            except Exception:  # noqa: BLE001 - prefetch is an optimisation; never take the engine down
                log.exception("prefetch cycle failed")

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)
        for fut in list(self._inflight.values()):
            fut.cancel()


def _log_failure(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("prefetch load failed: %s", fut.exception())
