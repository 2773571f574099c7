"""Admission policies: which waiting request gets the next free row, and which admitted prefill runs next.

- ``fcfs``: arrival order (the paper's policy).
- ``cache-aware``: least uncached work first - the tokens a request would still have to compute given what the
  cache holds when it is ranked (SGLang's longest-prefix-first idea, in tokens) - with **aging**: a request's
  priority improves by ``aging`` tokens per second of waiting, so nothing starves (after waiting
  ``uncached / aging`` seconds any request outranks a fully cached newcomer).

The aging rate is the machine's own prefill speed (`PrefillSpeed`, measured on the engine's prefill steps), so a
request waits about as long as its own prefill takes before newcomers stop overtaking it, on any machine. A fixed
rate would not: 2,000 tokens/s is a second of prefill on a fast CPU but seven on a 2-core AVX2 VM in float32,
where it turned cache-aware into arrival order after half a second of waiting (a cold 1.1k-token prompt admitted
first then held every hit behind its four-second prefill).

`rank` and `order_by` are pure functions of (candidates, now, aging): deterministic, testable with a fake clock.
The prefetch window follows the same order, so what is prefetched is what runs next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pcr_rag.errors import ConfigError

ScheduleName = Literal["fcfs", "cache-aware"]
SCHEDULES: tuple[str, ...] = ("fcfs", "cache-aware")
AGING_TOKENS_PER_S = 2000.0  # aging credit (tokens per second waited) until a prefill step has been measured
_SPEED_DECAY = 0.9  # weight of the past in `PrefillSpeed`'s decayed sums (per recorded step)


@dataclass(frozen=True)
class Candidate:
    """One request to rank: its arrival time (seconds, same clock as ``now``) and the tokens it still has to
    compute (uncached tokens while waiting, remaining prefill tokens once admitted)."""

    arrived_s: float
    work_tokens: int


class PrefillSpeed:
    """The engine's measured prefill speed in tokens per second: decayed sums of tokens over decayed sums of
    seconds of its prefill steps (so long steps weigh by their length and a short hit step's fixed cost does not
    pull the rate down), `AGING_TOKENS_PER_S` until a step is recorded. Written by the executor thread, read from
    any (one float)."""

    def __init__(self, initial: float = AGING_TOKENS_PER_S) -> None:
        self.tokens_per_s = float(initial)
        self._tokens = 0.0
        self._seconds = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """One prefill step: ``tokens`` positions computed in ``seconds`` (steps with neither are ignored)."""
        if tokens <= 0 or seconds <= 0:
            return
        self._tokens = _SPEED_DECAY * self._tokens + tokens
        self._seconds = _SPEED_DECAY * self._seconds + seconds
        self.tokens_per_s = self._tokens / self._seconds


def rank(schedule: str, candidates: Sequence[Candidate], now: float,
         aging: float = AGING_TOKENS_PER_S) -> list[int]:
    """Indices of ``candidates``, best first, under ``schedule`` (ties keep arrival order); ``aging``: tokens of
    priority per second waited (cache-aware)."""
    if schedule == "fcfs":
        return sorted(range(len(candidates)), key=lambda i: (candidates[i].arrived_s, i))
    if schedule == "cache-aware":
        def key(i: int) -> tuple[float, float, int]:
            c = candidates[i]
            return (c.work_tokens - aging * max(0.0, now - c.arrived_s), c.arrived_s, i)
        return sorted(range(len(candidates)), key=key)
    raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")


def order_by(schedule: str, items: Sequence, candidate: Callable[[object], Candidate], now: float,
             aging: float = AGING_TOKENS_PER_S) -> list:
    """``items`` reordered by `rank` of their candidates."""
    cands = [candidate(x) for x in items]
    return [items[i] for i in rank(schedule, cands, now, aging)]
