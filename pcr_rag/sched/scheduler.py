"""The waiting queue and the executor thread that runs engine steps.

One executor thread owns the model: each iteration it admits waiting requests into free rows - in the order of
the schedule (`pcr_rag.sched.admission`: ``fcfs`` or ``cache-aware``, with requests that share uncached
documents ranked as a group, `queue_candidates`) - and runs one engine step
(`BatchExecutor.step`: a fixed-shape decode over every decoding row, then at most one prefill chunk). Requests
enter from any thread or event loop; TTFT counts from submission, queueing included. `window` gives the waiting
requests in the order they will be admitted, and `prefetch_window` the chunk-key chains the prefetcher looks ahead at
(`pcr_rag.sched.lookahead.PrefetchWindow`: admitted rows not yet prefilling, this queue in that order, then the
announcement board): values the scheduler hands out, computed from its own inputs, never from the engine's facade.

Shutdown (`close`): no new requests; waiting ones fail with `EngineClosedError`; admitted ones finish within the
grace period, then fail with `EngineClosedError` too.

Nothing wedges the loop: the executor fails a request whose phase raises (`BatchExecutor._run`); a step that
raises outside any request fails every admitted request (their callers get the error, their rows come back); a
queue ranking that raises falls back to arrival order; a step that moved nothing makes the loop wait instead of
spinning; and if the loop itself dies, every waiting and admitted request fails and the scheduler closes, so no
caller waits forever.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pcr_rag.errors import EngineClosedError, QueueFullError, RequestFailedError
from pcr_rag.handle import RequestState
from pcr_rag.sched.admission import PrefillOutlook, PrefillSpeed, queue_order
from pcr_rag.sched.lookahead import PrefetchWindow, build_window
from pcr_rag.sched.request_state import Request

log = logging.getLogger(__name__)

STALLED_WAIT_S = 0.05  # sleep after a step that moved nothing (a submit wakes it sooner; a cancel is seen next step)


class StepExecutor(Protocol):
    """What the scheduler drives (`pcr_rag.sched.batch.BatchExecutor`)."""

    @property
    def free_rows(self) -> int: ...

    @property
    def idle(self) -> bool: ...

    def admit(self, req: Request) -> None: ...

    def in_flight_keys(self) -> set[bytes]: ...

    def waiting_keys(self) -> list[list[bytes]]: ...

    def step(self) -> bool: ...

    def fail_all(self, exc: BaseException) -> None: ...


class AnnouncedKeys(Protocol):
    """The announcement board as the prefetch window reads it (`pcr_rag.sched.announcements.AnnouncementBoard`)."""

    def keys(self, limit: int) -> list[tuple[bytes, ...]]: ...


class Scheduler:
    """Waiting queue + executor thread (see the module docstring).

    ``outlook_of(request)`` is a waiting request's outlook if admitted now (the tokens it would compute given the
    cache now, and the plan chunks after the cache's match): the engine hands in `lookahead.QueueOutlook` over its
    cache, a value, not a method of its own; ``speed`` is the engine's measured prefill speed, the cache-aware
    schedule's aging rate (the executor ranks its prefills with the same object); ``board``: announced requests,
    the tail of `prefetch_window` (None: none). Whoever must hear of queue changes (the prefetcher) registers with
    `watch`."""

    def __init__(self, executor: StepExecutor, *, schedule: str, max_queue: int,
                 outlook_of: Callable[[Request], PrefillOutlook], speed: PrefillSpeed,
                 board: AnnouncedKeys | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.executor = executor
        self.schedule = schedule
        self.max_queue = max_queue
        self.outlook_of = outlook_of
        self.speed = speed
        self.board = board
        self.clock = clock
        self._watchers: tuple[Callable[[], None], ...] = ()
        self._cond = threading.Condition()
        self._waiting: list[Request] = []
        self._closed = False
        self._abort = False
        self._ids = itertools.count(1)
        self.max_depth = 0
        self._thread = threading.Thread(target=self._main, name="pcr-executor", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------------------------------------------ queue
    def check_room(self) -> None:
        """Raise what `submit` would for a closed engine or a full queue, without queueing (a cheap check made
        before a request's costly preparation)."""
        with self._cond:
            self._check_room()

    def _check_room(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new PCREngine")
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")

    def submit(self, req: Request) -> Request:
        with self._cond:
            self._check_room()
            self._waiting.append(req)
            self.max_depth = max(self.max_depth, len(self._waiting))
            self._cond.notify_all()
        self._changed()
        return req

    def remove_waiting(self, req: Request) -> bool:
        with self._cond:
            if req in self._waiting:
                self._waiting.remove(req)
                return True
        return False

    def window(self, limit: int) -> list[Request]:
        """The next ``limit`` waiting requests in the order they will be admitted."""
        with self._cond:
            waiting = list(self._waiting)
        return self._ordered(waiting)[:limit]

    def prefetch_window(self, limit: int) -> PrefetchWindow:
        """The prefetch window of ``limit`` entries (`lookahead.build_window`): admitted requests whose prefill
        has not begun (the executor's), the waiting queue in admission order (`window`), then announced requests
        (``board``). Any thread; ranks the queue only when the admitted rows leave room."""
        return build_window(limit, self.executor.waiting_keys(), self.window,
                            None if self.board is None else self.board.keys)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the queue changes (a submit, an admission): the prefetcher's wake-up.
        Called from the submitting thread or the executor thread, so it must be quick and thread-safe."""
        with self._cond:
            self._watchers = (*self._watchers, callback)

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _ordered(self, waiting: list[Request]) -> list[Request]:
        """``waiting`` (arrival order) in admission order (`queue_order`: the oldest `ORDER_HORIZON` ranked).
        Ranking reads the cache; if it raises, arrival order (ranking only orders work, it never decides it)."""
        if self.schedule == "fcfs" or len(waiting) < 2:
            return waiting
        try:
            order = queue_order(self.schedule, len(waiting), lambda i: self.outlook_of(waiting[i]),
                                self.executor.in_flight_keys(), self.clock(), self.speed.tokens_per_s)
        except Exception:  # noqa: BLE001 - a broken cache must not stop admission
            log.exception("ranking the waiting queue failed; admitting in arrival order")
            return waiting
        return [waiting[i] for i in order]

    def _changed(self) -> None:
        for callback in self._watchers:  # a tuple, replaced whole by `watch`: read without the lock
            callback()

    # ------------------------------------------------------------------------------------------------- loop
    def _main(self) -> None:
        """The executor thread: `_loop`, and if it ever dies, every request fails rather than waiting forever."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the last resort: report to every caller, then stop
            log.critical("the executor loop stopped", exc_info=exc)
            error = EngineClosedError(f"the engine's executor stopped ({type(exc).__name__}: {exc}); create a new "
                                      f"PCREngine")
            with self._cond:
                self._closed = True
                pending, self._waiting = self._waiting, []
            _fail_waiting(pending, error)
            self.executor.fail_all(error)

    def _loop(self) -> None:
        ex = self.executor
        while True:
            with self._cond:
                while not self._waiting and ex.idle and not self._closed:
                    self._cond.wait()
                if self._abort or (self._closed and ex.idle):
                    break
                snapshot = list(self._waiting) if self._waiting and ex.free_rows else []
            admit: list[Request] = []
            if snapshot:  # ranked outside the lock (a cache match per request): `submit` never waits on it
                chosen = self._ordered(snapshot)[: ex.free_rows]
                with self._cond:  # one cancelled, failed or closed meanwhile is no longer waiting: it stays out
                    admit = [req for req in chosen if req in self._waiting]
                    for req in admit:
                        self._waiting.remove(req)
            if admit:
                self._changed()
                for req in admit:
                    try:
                        ex.admit(req)
                    except Exception as exc:  # noqa: BLE001 - the executor fails its own; this one never got in
                        log.exception("admitting request %s failed", req.request_id)
                        _fail_waiting([req], RequestFailedError(
                            f"request {req.request_id} could not be admitted ({type(exc).__name__}: {exc}); "
                            f"retry it"))
            if not ex.idle:
                try:
                    moved = ex.step()
                except Exception as exc:  # noqa: BLE001 - outside any request's phase: fail them all, keep serving
                    log.exception("engine step failed; failing every admitted request")
                    ex.fail_all(exc)
                    moved = True
                if not moved:  # nothing could run: sleep until new work (or a cancellation) rather than spin
                    with self._cond:
                        if not self._closed and not (self._waiting and ex.free_rows):
                            self._cond.wait(STALLED_WAIT_S)
        if not ex.idle:
            ex.fail_all(EngineClosedError("the engine was closed before this request finished"))

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting work; waiting requests fail now; admitted ones get ``timeout`` seconds to finish."""
        with self._cond:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        _fail_waiting(pending, EngineClosedError("the engine was closed before this request ran"))
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abort = True
            self._thread.join(timeout=30.0)


def _fail_waiting(requests: list[Request], error: BaseException) -> None:
    """Fail requests that hold no row (waiting, or refused at admission) with ``error``."""
    for req in requests:
        if not req.future.done():
            req.state = RequestState.FAILED
            req.future.set_exception(error)
