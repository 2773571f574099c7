"""Admission policies: which waiting request gets the next free row, and which admitted prefill runs next.

- ``fcfs``: arrival order (the paper's policy).
- ``cache-aware``: least uncached work first - the tokens a request would still have to compute given what the
  cache holds when it is ranked (SGLang's longest-prefix-first idea, in tokens) - with **aging**: a request's
  priority improves by `AGING_TOKENS_PER_S` tokens per second of waiting, so nothing starves (after waiting
  ``uncached / AGING_TOKENS_PER_S`` seconds any request outranks a fully cached newcomer).

Both are pure functions of (candidates, now): deterministic, testable with a fake clock. The prefetch window
follows the same order, so what is prefetched is what runs next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pcr_rag.errors import ConfigError

ScheduleName = Literal["fcfs", "cache-aware"]
SCHEDULES: tuple[str, ...] = ("fcfs", "cache-aware")
AGING_TOKENS_PER_S = 2000.0  # priority credit per second waited (about what one second of CPU prefill computes)


@dataclass(frozen=True)
class Candidate:
    """One request to rank: its arrival time (seconds, same clock as ``now``) and the tokens it still has to
    compute (uncached tokens while waiting, remaining prefill tokens once admitted)."""

    arrived_s: float
    work_tokens: int


def rank(schedule: str, candidates: Sequence[Candidate], now: float) -> list[int]:
    """Indices of ``candidates``, best first, under ``schedule`` (ties keep arrival order)."""
    if schedule == "fcfs":
        return sorted(range(len(candidates)), key=lambda i: (candidates[i].arrived_s, i))
    if schedule == "cache-aware":
        def key(i: int) -> tuple[float, float, int]:
            c = candidates[i]
            return (c.work_tokens - AGING_TOKENS_PER_S * max(0.0, now - c.arrived_s), c.arrived_s, i)
        return sorted(range(len(candidates)), key=key)
    raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")


def order_by(schedule: str, items: Sequence, candidate: Callable[[object], Candidate], now: float) -> list:
    """``items`` reordered by `rank` of their candidates."""
    cands = [candidate(x) for x in items]
    return [items[i] for i in rank(schedule, cands, now)]
