"""``CircuitBreaker``: stop calling a store that keeps failing, try it again after a back-off.

States: ``CLOSED`` (calls go through; ``errors_to_open`` consecutive failures, or ``trip()``, open it), ``OPEN`` (every call is
refused without touching the store until ``backoff_s`` seconds have passed), ``HALF_OPEN`` (one trial call goes
through, the others are refused; its success closes the breaker, its failure opens it for another back-off).
Thread-safe; time comes from an injectable clock (seconds).
"""

from __future__ import annotations

import threading
from enum import Enum

from pcr_rag.cache.clock import Clock, MonotonicClock

__all__ = ["BreakerState", "CircuitBreaker"]


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
