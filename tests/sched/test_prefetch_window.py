"""The prefetch window and the queue outlook are the scheduler's values (`pcr_rag.sched.lookahead`): computed from
its waiting queue, the executor's admitted rows, the announcement board and the cache, with no engine."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from pcr_rag.cache import Tier
from pcr_rag.sched.admission import PrefillOutlook, PrefillSpeed
from pcr_rag.sched.announcements import AnnouncementBoard
from pcr_rag.sched.lookahead import PrefetchWindow, QueueOutlook, build_window
from pcr_rag.sched.prefetcher import Prefetcher
from pcr_rag.sched.scheduler import Scheduler

CHUNK = 10  # tokens per chunk of the fake requests


@dataclass(frozen=True)
class _Match:
    keys: tuple[bytes, ...]
    tiers: tuple[Tier, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return CHUNK * len(self.keys)


class _FakeCache:
    """Cached chunk keys and their tiers; the longest cached prefix is the match, all of it worth loading."""

    remote_enabled = False

    def __init__(self, tiers: dict[bytes, Tier]) -> None:
        self.tiers = tiers
        self.matched: list[tuple[bytes, ...]] = []
        self.lookahead: frozenset[bytes] | None = None

    def match(self, keys) -> _Match:
        self.matched.append(tuple(keys))
        n = 0
        while n < len(keys) and keys[n] in self.tiers:
            n += 1
        return _Match(tuple(keys[:n]), tuple(self.tiers[k] for k in keys[:n]))

    def reuse_limit(self, keys) -> int:
        return self.match(keys).num_chunks

    def set_lookahead(self, keys) -> None:
        self.lookahead = frozenset(keys)


class _BusyExecutor:
    """No free row: requests stay queued. ``admitted``: the chains of admitted prefills that have not begun."""

    def __init__(self, admitted: list[list[bytes]]) -> None:
        self.admitted = admitted
        self.stepped = threading.Event()

    free_rows = 0
    idle = False  # set by the test before closing, so the loop ends at once

    def admit(self, req) -> None:
        raise AssertionError("no row is free")

    def in_flight_keys(self) -> set[bytes]:
        return set()

    def waiting_keys(self) -> list[list[bytes]]:
        return [list(c) for c in self.admitted]

    def step(self) -> None:
        self.stepped.wait(0.001)

    def fail_all(self, exc: BaseException) -> None:
        pass


def _request(name: str, n_chunks: int, blend: tuple[tuple[bytes, ...], ...] | None = None) -> SimpleNamespace:
    keys = [f"{name}{i}".encode() for i in range(n_chunks)]
    plan = [SimpleNamespace(key=k, num_tokens=CHUNK) for k in keys]
    return SimpleNamespace(name=name, keys=keys, plan=plan, token_ids=[0] * (CHUNK * n_chunks), submitted_at=0.0,
                           blend=None if blend is None else SimpleNamespace(chains=blend),
                           future=concurrent.futures.Future(), state=None)


def _scheduler(ex: _BusyExecutor, cache: _FakeCache, board: AnnouncementBoard | None,
               schedule: str = "cache-aware") -> Scheduler:
    return Scheduler(ex, schedule=schedule, max_queue=16, outlook_of=QueueOutlook(cache), speed=PrefillSpeed(1.0),
                     board=board, clock=lambda: 0.0)


def _close(sched: Scheduler, ex: _BusyExecutor) -> None:
    ex.idle = True
    sched.close(timeout=5.0)


def test_the_scheduler_hands_out_the_window_in_order_and_the_prefetcher_reads_it():
    """Admitted prefills not yet begun first, then the waiting queue in admission order (cache-aware: the request
    whose prefix is cached, ``hit``, outranks the cold one that arrived first; a blend request's document chains
    follow its own), then announced requests. The prefetcher protects every chunk of that window and plans the
    SSD chunks in its order, with no engine anywhere."""
    cache = _FakeCache({b"hit0": Tier.SSD, b"hit1": Tier.SSD, b"adm0": Tier.DRAM, b"ann0": Tier.SSD})
    board = AnnouncementBoard(60.0, clock=lambda: 0.0)
    board.add(("doc",), [b"ann0", b"ann1"])
    ex = _BusyExecutor([[b"adm0", b"adm1"]])
    sched = _scheduler(ex, cache, board)
    woken = threading.Event()
    sched.watch(woken.set)
    try:
        for req in (_request("cold", 3), _request("hit", 3, blend=((b"docA",),))):
            sched.submit(req)
        assert woken.is_set(), "a submit wakes whoever watches the queue"
        window = sched.prefetch_window(6)
        assert window == PrefetchWindow(
            admitted=((b"adm0", b"adm1"),),
            waiting=((b"hit0", b"hit1", b"hit2"), (b"docA",), (b"cold0", b"cold1", b"cold2")),
            announced=((b"ann0", b"ann1"),))
        assert list(window.chains) == [*window.admitted, *window.waiting, *window.announced]

        prefetcher = Prefetcher(cache, sched, window=6, do_loads=False, protect=True, interval_s=60.0)
        try:
            plan = prefetcher.run_cycle()
        finally:
            prefetcher.close()
        assert prefetcher.last_window == window
        assert plan.load == (b"hit0", b"hit1", b"ann0")  # SSD chunks of the matched prefixes, in window order
        assert plan.protect == frozenset(k for chain in window.chains for k in chain) == cache.lookahead
    finally:
        _close(sched, ex)


def test_a_full_window_neither_ranks_the_queue_nor_reads_the_board():
    """The limit counts chains: admitted chains past it are cut; when they fill it, the queue is not ranked (no
    cache match per waiting request) and the board is not read. A request is never split: its blend chains may
    take the window past the limit. fcfs keeps arrival order."""
    cache = _FakeCache({})
    board = AnnouncementBoard(60.0, clock=lambda: 0.0)
    board.add(("doc",), [b"ann0"])
    ex = _BusyExecutor([[b"a"], [b"b"], [b"c"]])
    sched = _scheduler(ex, cache, board)
    try:
        sched.submit(_request("x", 1))
        sched.submit(_request("y", 1))
        cache.matched.clear()
        assert sched.prefetch_window(2) == PrefetchWindow(admitted=((b"a",), (b"b",)))
        assert cache.matched == [], "a full window ranked the queue"
        assert sched.prefetch_window(0) == PrefetchWindow()
    finally:
        _close(sched, ex)

    ex = _BusyExecutor([[b"a"]])
    sched = _scheduler(ex, cache, board, schedule="fcfs")
    try:
        sched.submit(_request("x", 1, blend=((b"d1",), (b"d2",))))
        sched.submit(_request("y", 1))
        window = sched.prefetch_window(2)
        assert window == PrefetchWindow(admitted=((b"a",),), waiting=((b"x0",), (b"d1",), (b"d2",)))
        assert len(window) == 4  # past the limit by x's document chains; no room left for y or the board
        assert sched.prefetch_window(5).waiting[-1] == (b"y0",)
        assert sched.prefetch_window(6).announced == ((b"ann0",),)
    finally:
        _close(sched, ex)


def test_build_window_without_a_board():
    window = build_window(4, [[b"a"]], lambda n: [_request("q", 2)][:n], None)
    assert window == PrefetchWindow(admitted=((b"a",),), waiting=((b"q0", b"q1"),))


def test_the_queue_outlook_is_the_prompt_less_the_cached_prefix():
    """`QueueOutlook` over the cache: the tokens left after the cached prefix and the plan chunks after it; without
    a cache, the whole prompt and no chunks."""
    req = _request("r", 3)
    req.submitted_at = 2.5
    assert QueueOutlook(_FakeCache({b"r0": Tier.DRAM}))(req) == PrefillOutlook(
        2.5, 2 * CHUNK, {b"r1": CHUNK, b"r2": CHUNK}, begun=False)
    assert QueueOutlook(None)(req) == PrefillOutlook(2.5, 3 * CHUNK, {}, begun=False)
