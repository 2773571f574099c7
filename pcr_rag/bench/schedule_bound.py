"""How much any admission order could change mean TTFT on a measured trace: the schedule bound.

An admission policy only decides *which* pending prefill runs next; it cannot shorten a prefill, and a request
that arrives while nothing else is pending starts at once under any policy. So on a lightly loaded trace no
policy can gain much, however clever. This module puts a number on that, from a measured FCFS run:

- Each request is a job released at its arrival with the prefill work it took under FCFS (``prefill_compute``:
  its own prefill steps, KV waits included; seconds).
- The engine computes one forward at a time, and a prefill may be paused between chunk steps, so the model is
  one machine with preemption. On it, shortest remaining work first (SRPT) minimises the mean flow time (Schrage,
  1968): no order of the same work finishes the prefills sooner on average.
- ``fcfs_mean_s`` and ``best_mean_s`` are the mean flow times of FCFS and SRPT over that same work, and
  ``ratio = best / fcfs`` is the largest mean-TTFT gain reordering can bring on this trace - the policy's effect
  with the requests' work held fixed, free of the run-to-run noise of the work itself.

What the model leaves out makes it generous to reordering: other requests' decode steps (they delay every
policy alike), and preemption at any instant (the engine pauses a prefill only between steps). What it cannot
see: an order that lets a request reuse documents another pending request computes would shrink that request's
work; ``overlapping`` counts the requests for which any order could matter at all (they arrive while another
request's prefill is still unfinished under FCFS).

What a measured ratio holds besides the policy: the same work does not take the same time in two runs of one
bench, minutes apart on a shared host (see docs/measurements-history.md#figures-moved-from-code-comments).
``speed_ratio`` is the cache-aware run's prefill seconds per computed token over
the FCFS run's: where it is far from 1, so is the measured TTFT ratio, whatever the order did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pcr_rag.bench.report import rates, run_for

__all__ = ["CACHE_AWARE_SYSTEM", "DRIFT_MARGIN", "FCFS_SYSTEM", "ScheduleBound", "fcfs_flow_times", "schedule_bound",
           "schedule_bounds", "seconds_per_computed_token", "srpt_flow_times", "target_note"]

#: The run whose per-request work the bound is computed from, and the run it is compared with.
FCFS_SYSTEM = "pcr-schedule-fcfs"
CACHE_AWARE_SYSTEM = "pcr-schedule-cache-aware"


def _check(arrivals: Sequence[float], works: Sequence[float]) -> None:
    if len(arrivals) != len(works):
        raise ValueError(f"{len(arrivals)} arrivals but {len(works)} works")
    if any(w < 0 or not math.isfinite(w) for w in works) or any(not math.isfinite(a) for a in arrivals):
        raise ValueError("works must be finite and >= 0, arrivals finite")


def fcfs_flow_times(arrivals: Sequence[float], works: Sequence[float]) -> list[float]:
    """Completion minus arrival of each job served to the end in arrival order (ties: list order); seconds."""
    _check(arrivals, works)
    out = [0.0] * len(works)
    free = -math.inf
    for i in sorted(range(len(works)), key=lambda j: (arrivals[j], j)):
        free = max(free, arrivals[i]) + works[i]
        out[i] = free - arrivals[i]
    return out


def srpt_flow_times(arrivals: Sequence[float], works: Sequence[float]) -> list[float]:
    """Completion minus arrival of each job under shortest-remaining-work-first with preemption (ties: earlier
    arrival, then list order): the least mean flow time of one machine over these jobs; seconds."""
    _check(arrivals, works)
    n = len(works)
    order = sorted(range(n), key=lambda j: (arrivals[j], j))
    left = list(works)
    out = [0.0] * n
    pending: list[int] = []
    now, nxt = -math.inf, 0
    while nxt < n or pending:
        if not pending:
            now = max(now, arrivals[order[nxt]])
        while nxt < n and arrivals[order[nxt]] <= now:
            pending.append(order[nxt])
            nxt += 1
        job = min(pending, key=lambda j: (left[j], arrivals[j], j))
        until = arrivals[order[nxt]] if nxt < n else math.inf  # the next arrival may preempt it
        run = min(left[job], until - now)
        now += run
        left[job] -= run
        if left[job] <= 0.0:
            pending.remove(job)
            out[job] = now - arrivals[job]
    return out


@dataclass(frozen=True)
class ScheduleBound:
    """The schedule bound of one trace (or the repeats of one rate): means in seconds over ``requests``."""

    rate: float
    requests: int
    overlapping: int      # requests arriving while another's prefill is unfinished under FCFS
    fcfs_mean_s: float    # FCFS over the measured work (the model's FCFS, not the measured TTFT)
    best_mean_s: float    # SRPT over the same work: no admission order does better
    measured_fcfs_mean_s: float  # the FCFS run's measured mean TTFT (decode steps and noise included)
    speed_ratio: float = math.nan  # cache-aware run's prefill s per computed token / the FCFS run's (same work)

    @property
    def ratio(self) -> float:
        """The least mean TTFT any admission order reaches, over FCFS's (1.0: order cannot matter)."""
        return self.best_mean_s / self.fcfs_mean_s if self.fcfs_mean_s > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN as None)."""
        out = {**asdict(self), "ratio": self.ratio, "line": self.line()}
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}

    def line(self) -> str:
        speed = ("" if math.isnan(self.speed_ratio) else
                 f"; the cache-aware run computed at {self.speed_ratio:.2f}x the FCFS run's seconds per token")
        return (f"at {self.rate:.3g} req/s no admission order gets mean TTFT below {self.ratio:.3f}x FCFS "
                f"(shortest remaining prefill first over the FCFS run's prefill work: {self.best_mean_s * 1e3:.0f} "
                f"vs {self.fcfs_mean_s * 1e3:.0f} ms; {self.overlapping} of {self.requests} requests arrive while "
                f"another prefill is unfinished{speed})")


def schedule_bound(arrivals: Sequence[float], works: Sequence[float], *, repeats: Sequence[int] | None = None,
                   rate: float = math.nan, measured_ttft: Sequence[float] = (),
                   speed_ratio: float = math.nan) -> ScheduleBound:
    """The bound of a trace: ``arrivals`` (seconds), ``works`` (each request's prefill seconds). ``repeats`` (one
    label per request) splits it into traces that never share the machine (a bench's repeats), each simulated on
    its own; means over all requests."""
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(repeats if repeats is not None else [0] * len(works)):
        groups.setdefault(int(label), []).append(i)
    fcfs_sum = best_sum = 0.0
    overlapping = 0
    for idx in groups.values():
        a, w = [arrivals[i] for i in idx], [works[i] for i in idx]
        fcfs = fcfs_flow_times(a, w)
        fcfs_sum += sum(fcfs)
        best_sum += sum(srpt_flow_times(a, w))
        overlapping += sum(1 for f, x in zip(fcfs, w, strict=True) if f > x + 1e-12)  # it waited under FCFS
    n = len(works)
    return ScheduleBound(rate, n, overlapping, fcfs_sum / n if n else 0.0, best_sum / n if n else 0.0,
                         sum(measured_ttft) / len(measured_ttft) if measured_ttft else math.nan, speed_ratio)


def seconds_per_computed_token(run: Mapping[str, Any]) -> float:
    """A run's prefill seconds (its own steps) per prompt token it computed; NaN when it computed none."""
    computed = run["tokens"]["computed"]
    return sum(run["requests"]["prefill_compute"]) / computed if computed > 0 else math.nan


def schedule_bounds(report: Mapping[str, Any], system: str = FCFS_SYSTEM,
                    compare: str = CACHE_AWARE_SYSTEM) -> list[ScheduleBound]:
    """The bound at every finite rate where ``system`` ran, its repeats simulated apart (`schedule_bound`);
    ``speed_ratio`` against ``compare``'s run at that rate (NaN without one). Empty when the report has no
    ``system`` run."""
    out = []
    for rate in rates(report):
        run = run_for(report, system, rate)
        if run is None or math.isinf(rate) or not run.get("requests"):
            continue
        req = run["requests"]
        other = run_for(report, compare, rate)
        speed = (seconds_per_computed_token(other) / seconds_per_computed_token(run)
                 if other is not None and other.get("requests") else math.nan)
        out.append(schedule_bound(req["arrival"], req["prefill_compute"], repeats=[k[0] for k in req["key"]],
                                  rate=rate, measured_ttft=req["ttft"], speed_ratio=speed))
    return out


#: How far below the bound a measured ratio must be before the report blames the runs' speed (the bound holds the
#: work fixed; a couple of percent is the noise of the work itself).
DRIFT_MARGIN = 0.02


def target_note(target: Mapping[str, Any], bound: Mapping[str, Any] | None) -> str | None:
    """What the admission bound says about a judged admission target (a `TargetResult.as_dict` comparing the
    cache-aware and FCFS runs, ``max_ratio`` its bound) at the rate of ``bound`` (a `ScheduleBound.as_dict`):
    that no order can meet the target on this trace, and/or that the measured ratio is more than `DRIFT_MARGIN`
    below what any order can reach (so the runs' speed made it, not the order). None when neither holds."""
    ratio = target.get("ratio")
    if bound is None or ratio is None:
        return None
    best, limit = bound["ratio"], target["max_ratio"]
    speed = bound.get("speed_ratio")
    drift = "" if speed is None else (f"; the cache-aware run computed the same work at {speed:.2f}x the FCFS run's "
                                      "seconds per token")
    below = ratio < best - DRIFT_MARGIN
    why = (", below what any order reaches: the machine's speed between the two runs made the difference, not the "
           "order" if below else "")
    if best > limit:
        return (f"{target['name']}: unreachable on this trace whatever the policy - the best admission order gets "
                f"{best:.3f}x; measured {ratio:.2f}x{why}{drift}")
    if below:
        return f"{target['name']}: measured {ratio:.2f}x against a best order of {best:.3f}x{why}{drift}"
    return None
