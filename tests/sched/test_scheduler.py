"""The waiting queue's order (`Scheduler.window`, what admission and the prefetcher follow), with a fake executor."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

from pcr_rag.sched.admission import PrefillOutlook, PrefillSpeed
from pcr_rag.sched.scheduler import Scheduler


class _BusyExecutor:
    """No free row, always busy: requests stay queued, so the test reads the queue's order."""

    def __init__(self, in_flight: set[bytes]) -> None:
        self.in_flight = in_flight
        self.stepped = threading.Event()

    free_rows = 0
    idle = False  # set by the test before closing, so the loop ends at once

    def admit(self, req) -> None:
        raise AssertionError("no row is free")

    def in_flight_keys(self) -> set[bytes]:
        return set(self.in_flight)

    def step(self) -> None:
        self.stepped.wait(0.001)

    def fail_all(self, exc: BaseException) -> None:
        pass


def _chunks(*names: str, tokens: int) -> dict[bytes, int]:
    return {n.encode(): tokens for n in names}


OUTLOOKS = {  # name -> (work, chunks); all arrive at t=0
    "lone": (500, _chunks("z", tokens=500)),
    "follower": (840, {**_chunks("a", "b", tokens=400), b"q": 40}),  # its documents are in flight
    "first": (830, {**_chunks("c", "d", tokens=400), b"x": 30}),  # these two share cold documents
    "second": (850, {**_chunks("c", "d", tokens=400), b"y": 50}),
}


def _queue(schedule: str, in_flight: set[bytes]) -> list[str]:
    ex = _BusyExecutor(in_flight)
    sched = Scheduler(ex, schedule=schedule, max_queue=16,
                      outlook_of=lambda r: PrefillOutlook(0.0, *OUTLOOKS[r.name], begun=False),
                      speed=PrefillSpeed(1.0), clock=lambda: 0.0)
    try:
        for name in OUTLOOKS:
            sched.submit(SimpleNamespace(name=name, future=concurrent.futures.Future(), state=None))
        return [r.name for r in sched.window(8)]
    finally:
        ex.idle = True
        sched.close(timeout=5.0)


def test_the_queue_counts_in_flight_chunks_as_reuse_and_ranks_groups():
    """Cache-aware: the follower's documents are being computed by an admitted prefill, so its work is its 40-token
    tail and it goes first; the pair on the same cold documents ranks at (830 + 50) / 2 = 440 tokens per request,
    ahead of the lone 500-token prompt although each has more work alone. Without anything in flight the follower
    ranks by its whole prompt (last). fcfs keeps arrival order."""
    assert _queue("cache-aware", {b"a", b"b"}) == ["follower", "first", "second", "lone"]
    assert _queue("cache-aware", set()) == ["first", "second", "lone", "follower"]
    assert _queue("fcfs", {b"a", b"b"}) == list(OUTLOOKS)


class _OneRowExecutor:
    """Busy until the test frees one row; records what it admits."""

    def __init__(self) -> None:
        self.free_rows = 0
        self.idle = False
        self.admitted: list[str] = []

    def admit(self, req) -> None:
        self.admitted.append(req.name)
        self.free_rows = 0

    def in_flight_keys(self) -> set[bytes]:
        return set()

    def step(self) -> None:
        time.sleep(0.001)

    def fail_all(self, exc: BaseException) -> None:
        pass


def test_ranking_runs_outside_the_lock_and_a_request_cancelled_meanwhile_stays_out():
    """The queue is ranked on a snapshot without holding the scheduler's lock (each outlook is a cache match:
    tens of ms for a deep queue), so `submit` and cancellation never wait on it; a request removed while it was
    being ranked is not admitted, the next one is."""
    ranking, release = threading.Event(), threading.Event()

    def outlook_of(req) -> PrefillOutlook:
        if req.name == "a" and not ranking.is_set():  # the first ranking blocks here
            ranking.set()
            release.wait(10)
        return PrefillOutlook(0.0, 100, {}, begun=False)

    ex = _OneRowExecutor()
    sched = Scheduler(ex, schedule="cache-aware", max_queue=16, outlook_of=outlook_of, speed=PrefillSpeed(1.0),
                      clock=lambda: 0.0)
    reqs = {n: SimpleNamespace(name=n, future=concurrent.futures.Future(), state=None) for n in "abc"}
    try:
        sched.submit(reqs["a"])
        sched.submit(reqs["b"])
        ex.free_rows = 1
        assert ranking.wait(5), "the scheduler ranks the two waiting requests"
        t0 = time.monotonic()
        sched.submit(reqs["c"])
        assert sched.remove_waiting(reqs["a"])
        assert time.monotonic() - t0 < 0.5, "submit and cancel waited for the ranking"
        release.set()
        deadline = time.monotonic() + 5
        while not ex.admitted and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ex.admitted == ["b"]
    finally:
        release.set()
        ex.idle = True
        sched.close(timeout=5.0)
