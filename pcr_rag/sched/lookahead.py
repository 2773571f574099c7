"""What the scheduler hands out about the work ahead: a waiting request's outlook and the prefetch window.

Both are computed here from the scheduler's own inputs - its waiting queue, the executor's admitted rows, the
announcement board and the cache (engine state handed in at construction) - so "what does the prefetcher see?"
is answered in `pcr_rag.sched` alone, never by a call back into the engine's facade:

- `QueueOutlook`: how the waiting queue ranks a request (`pcr_rag.sched.admission.queue_order`): the tokens it
  would compute if admitted now and its plan chunks after the cache's match.
- `PrefetchWindow`: the chunk-key chains the prefetcher protects and loads (`pcr_rag.sched.prefetcher`), in the
  order they will be needed; `build_window` assembles it (`Scheduler.prefetch_window` gathers the inputs).

The simulator mirrors both (`pcr_rag.sim.simulator`: ``_outlook``, ``_refresh_prefetch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pcr_rag.sched.admission import CacheMatch, PlanChunk, PrefillOutlook

Chain = tuple[bytes, ...]


class PlanMatcher(Protocol):
    """The cache as the outlook reads it (`pcr_rag.cache.CacheManager.match`: read-only, no pin, no stats)."""

    def match(self, keys: Sequence[bytes]) -> CacheMatch: ...


class WaitingRequest(Protocol):
    """A waiting request as the outlook and the window read it (`pcr_rag.sched.request_state.Request`)."""

    @property
    def submitted_at(self) -> float: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def plan(self) -> Sequence[PlanChunk]: ...

    @property
    def keys(self) -> Sequence[bytes]: ...


@dataclass(frozen=True)
class QueueOutlook:
    """How the waiting queue sees a request: ``outlook(req)`` is its `PrefillOutlook` if admitted now - its prompt
    less the cached prefix of its plan, and the plan chunks after that prefix (`PrefillOutlook.not_begun`).

    ``cache``: the engine's cache, or None without one (then all of the prompt is work and no chunk is named).
    A value holding the cache, not a callback into the engine: the scheduler calls it outside its lock, so it
    must only read (``match`` takes no pin and counts nothing)."""

    cache: PlanMatcher | None

    def __call__(self, req: WaitingRequest) -> PrefillOutlook:
        match = None if self.cache is None else self.cache.match(req.keys)
        return PrefillOutlook.not_begun(req.submitted_at, len(req.token_ids), req.plan, match)


@dataclass(frozen=True)
class PrefetchWindow:
    """The chunk-key chains the prefetcher looks ahead at, in the order they will be needed:

    - ``admitted``: admitted requests whose prefill has not begun, oldest first (`BatchExecutor.waiting_keys`);
    - ``waiting``: the waiting queue in admission order (`Scheduler.window`), each request's prefix chain followed
      by a blend request's documents' position-independent chains;
    - ``announced``: announced requests in board order (`AnnouncementBoard.keys`: each ticket's chains).

    Invariant (from `build_window`): a later part is non-empty only if the earlier ones left room under the
    limit, counted in chains; a request or ticket is never split, so the window may exceed the limit by the extra
    chains of its last request or ticket."""

    admitted: tuple[Chain, ...] = ()
    waiting: tuple[Chain, ...] = ()
    announced: tuple[Chain, ...] = ()

    @property
    def chains(self) -> tuple[Chain, ...]:
        """Every chain, in window order (what `plan_prefetch` takes)."""
        return self.admitted + self.waiting + self.announced

    def __len__(self) -> int:
        return len(self.admitted) + len(self.waiting) + len(self.announced)


def request_chains(req: WaitingRequest) -> list[Chain]:
    """A request's chains in the window: its prefix chain, then (blend mode) its documents' chains."""
    blend = getattr(req, "blend", None)
    return [tuple(req.keys), *(tuple(c) for c in (blend.chains if blend is not None else ()))]


def build_window(limit: int, admitted: Sequence[Sequence[bytes]],
                 waiting: Callable[[int], Sequence[WaitingRequest]],
                 announced: Callable[[int], Sequence[Sequence[bytes]]] | None) -> PrefetchWindow:
    """The `PrefetchWindow` of at most ``limit`` entries (see its invariant): the first ``limit`` of the
    ``admitted`` chains; if room is left, the chains of ``waiting(n)`` (the next ``n`` waiting requests in
    admission order, ``n`` = the room left); if room is still left, ``announced(n)`` (the chains of the next
    ``n`` announcements; None: no board). The later sources are asked only when room is left, so a full window
    never ranks the queue (a cache match per waiting request)."""
    head = tuple(tuple(c) for c in list(admitted)[:limit])
    queue: list[Chain] = []
    if len(head) < limit:
        for req in waiting(limit - len(head)):
            queue.extend(request_chains(req))
    tail: tuple[Chain, ...] = ()
    room = limit - len(head) - len(queue)
    if room > 0 and announced is not None:
        tail = tuple(tuple(c) for c in announced(room))
    return PrefetchWindow(head, tuple(queue), tail)
