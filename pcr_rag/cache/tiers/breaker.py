"""``CircuitBreaker``: stop calling a store that keeps failing, try it again after a back-off.

States: ``CLOSED`` (calls go through; ``errors_to_open`` consecutive failures, or ``trip()``, open it), ``OPEN`` (every call is
refused without touching the store until ``backoff_s`` seconds have passed), ``HALF_OPEN`` (one trial call goes
through, the others are refused; its success closes the breaker, its failure opens it for another back-off).
Thread-safe; time comes from an injectable clock (seconds).

``BreakerSet``: one breaker per node of a sharded store (a Valkey/Redis Cluster), made on first use with the same
settings, so one failing node is skipped while the others are still called.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from enum import Enum

from pcr_rag.cache.clock import Clock, MonotonicClock

__all__ = ["BreakerSet", "BreakerState", "CircuitBreaker"]


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """See the module docstring. ``allow()`` before a call, then exactly one of ``success()`` / ``failure()``."""

    def __init__(self, errors_to_open: int, backoff_s: float, clock: Clock | None = None) -> None:
        if errors_to_open < 1 or backoff_s <= 0:
            raise ValueError(f"need errors_to_open >= 1 and backoff_s > 0, got {errors_to_open}, {backoff_s}")
        self.errors_to_open = errors_to_open
        self.backoff_s = backoff_s
        self.clock = clock or MonotonicClock()
        self.trips = 0  # times the breaker opened
        self._state = BreakerState.CLOSED
        self._errors = 0  # consecutive failures while closed
        self._open_until = 0.0
        self._trial_out = False
        self._lock = threading.Lock()

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self.clock.now() >= self._open_until:
                return BreakerState.HALF_OPEN
            return self._state

    def available(self) -> bool:
        """Whether a call would be let through now (no state change: for skipping work before any call)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            return not self._trial_out and self.clock.now() >= self._open_until

    def allow(self) -> bool:
        """Whether this call may go to the store; a half-open breaker lets one trial call through at a time."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._trial_out or self.clock.now() < self._open_until:
                return False
            self._state = BreakerState.HALF_OPEN
            self._trial_out = True
            return True

    def success(self) -> None:
        with self._lock:
            if self._state is BreakerState.OPEN:
                return  # a call that began before the breaker opened: the trial decides
            self._state = BreakerState.CLOSED
            self._errors = 0
            self._trial_out = False

    def trip(self) -> None:
        """Open now, whatever the count (a timed-out call already cost its caller the whole timeout: no second
        caller should pay it before the back-off has passed)."""
        with self._lock:
            self._trial_out = False
            if self._state is BreakerState.OPEN:
                return
            self._state = BreakerState.OPEN
            self._errors = 0
            self._open_until = self.clock.now() + self.backoff_s
            self.trips += 1

    def failure(self) -> None:
        with self._lock:
            self._trial_out = False
            if self._state is BreakerState.CLOSED:
                self._errors += 1
                if self._errors < self.errors_to_open:
                    return
            elif self._state is BreakerState.OPEN:
                return  # a call that began before the breaker opened
            self._state = BreakerState.OPEN
            self._errors = 0
            self._open_until = self.clock.now() + self.backoff_s
            self.trips += 1


class BreakerSet:
    """A ``CircuitBreaker`` per node name (``host:port``), each with ``errors_to_open`` / ``backoff_s`` and the
    shared clock. Thread-safe."""

    def __init__(self, errors_to_open: int, backoff_s: float, clock: Clock | None = None) -> None:
        CircuitBreaker(errors_to_open, backoff_s)  # validates the settings before any node is seen
        self.errors_to_open = errors_to_open
        self.backoff_s = backoff_s
        self.clock = clock or MonotonicClock()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()

    def get(self, node: str) -> CircuitBreaker:
        """The breaker of ``node`` (a closed one the first time the node is named)."""
        with self._lock:
            breaker = self._breakers.get(node)
            if breaker is None:
                breaker = self._breakers[node] = CircuitBreaker(self.errors_to_open, self.backoff_s, self.clock)
            return breaker

    def not_closed(self, nodes: Iterable[str]) -> list[str]:
        """Those of ``nodes`` whose breaker is open or half-open (a node never named has a closed one)."""
        with self._lock:
            known = dict(self._breakers)
        return [n for n in nodes if (b := known.get(n)) is not None and b.state is not BreakerState.CLOSED]

    @property
    def trips(self) -> int:
        """Times any node's breaker opened."""
        with self._lock:
            return sum(b.trips for b in self._breakers.values())
