"""Injectable time source. The engine stamps LRU recency with ``clock.now()`` (seconds, monotonic); ties are
broken by an internal counter, so a frozen ``ManualClock`` still gives a strict, deterministic LRU order."""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "MonotonicClock"]


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Current time in seconds (monotonic, arbitrary origin)."""
        ...


class MonotonicClock:
    """Wall time via ``time.monotonic``."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to (tests, the simulator's virtual time)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, t: float) -> None:
        with self._lock:
            if t < self._now:
                raise ValueError(f"a clock cannot go backwards ({t} < {self._now})")
            self._now = float(t)
