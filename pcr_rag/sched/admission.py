"""Admission policies: which waiting request gets the next free row, and which admitted prefill runs next.

- ``fcfs``: arrival order (the paper's policy).
- ``cache-aware``: least uncached work first - the tokens a request would still have to compute given what the
  cache holds when it is ranked (SGLang's longest-prefix-first idea, in tokens) - with **aging**: a request's
  priority improves by ``aging`` tokens per second of waiting, so nothing starves (after waiting
  ``uncached / aging`` seconds any request outranks a fully cached newcomer). Waiting counts from arrival, and a
  prefill's own steps count as waiting only against the requests that were already there while they ran:
  - against those, counting them keeps shortest-remaining-work order: a prefill that outranked a request when it
    began keeps outranking it, as its work shrinks while their credits grow alike. Leaving them out was tried: a
    nearly finished prefill then fell behind colder requests that had waited longer, and mean TTFT grew (see
    docs/measurements-history.md#figures-moved-from-code-comments);
  - against a request that arrived later, counting them would let a cold prompt past about half its prefill
    outrank every hit (its credit, at the engine's own speed, grows as fast as its work shrinks), so a hit arriving
    part-way into a cold prompt would wait for the rest of it. Against such a newcomer only the time the prefill
    waited counts, so the two
    rank by remaining work plus real waiting, and a prefill preempted by hit after hit still gains on the next
    one: nothing starves.
  This is a relation between pairs, not one key per request: `rank` puts first the request that outranks every
  other pairwise, and falls back to the single key (service counted against all) when no request does. The
  service before a newcomer's arrival is taken as the prefill's steps up to then, at most the time since it
  began (``began_s``, ``served_s``): exact for a prefill computed without pause since it began, otherwise an
  over-estimate that favours the newcomer.

The aging rate is the machine's own prefill speed (`PrefillSpeed`, measured on the engine's prefill steps), so a
request waits about as long as its own prefill takes before newcomers stop overtaking it, on any machine. A fixed
rate would not: a rate tuned on a fast CPU is several times the prefill speed of a slow one, where it turns
cache-aware into arrival order after a fraction of a second of waiting (a cold prompt admitted first then holds
every hit behind its whole prefill).

Admitted prefills that share documents are ranked together (`prefill_candidates`): a prefill whose next chunks
another running prefill is computing waits for them (it would compute them twice) and lends that prefill its
place - without this a cold prefill that others wait on is overtaken by every newer hit while they wait on it.
Under ``cache-aware`` a prefill's work is its group's work per request served:
the least ``(own + residual work of the k cheapest prefills that reuse its chunks) / (1 + k)`` over k, Smith's
rule (shortest weighted work first, which minimises mean completion time) with a request's TTFT as its weight.

The waiting queue ranks the same way (`queue_candidates`): a waiting request's work leaves out the chunks admitted
prefills will compute (it reuses them once admitted), and waiting requests that share uncached documents rank as a
group, so when every row is taken the next free row goes to the request that ends the most waiting per token.

Ranking a waiting queue compares every pair of requests that share uncached chunks, O(n^2) in Python, which a
deep queue pays at every admission (see docs/measurements-history.md#figures-moved-from-code-comments). So
`queue_order` ranks only the `ORDER_HORIZON` oldest waiting requests; later arrivals wait
behind them in arrival order (SGLang's longest-prefix policy falls back to FCFS past 128 waiting for the same
reason). Aging already serves a deep queue's oldest requests first.

`rank`, `prefill_candidates`, `queue_candidates` and `queue_order` are pure functions of their arguments:
deterministic, testable with a fake clock. The prefetch window follows the queue's order, so what is prefetched is
what runs next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pcr_rag.errors import ConfigError

ScheduleName = Literal["fcfs", "cache-aware"]
SCHEDULES: tuple[str, ...] = ("fcfs", "cache-aware")
AGING_TOKENS_PER_S = 2000.0  # aging credit (tokens per second waited) until a prefill step has been measured
_SPEED_DECAY = 0.9  # weight of the past in `PrefillSpeed`'s decayed sums (per recorded step)
ORDER_HORIZON = 128  # oldest waiting requests the cache-aware queue order ranks (see the module docstring)


@dataclass(frozen=True)
class Candidate:
    """One request to rank (seconds on the same clock as ``now``; tokens):

    - ``arrived_s``: arrival (the earliest of the requests its rank speaks for: `prefill_candidates`);
    - ``work_tokens``: tokens it still has to compute (uncached tokens while waiting, remaining prefill tokens once
      admitted);
    - ``began_s``, ``served_s``: when its own prefill began and the seconds its steps have run since (inf and 0
      before it begins);
    - ``waiting_s``: the earliest arrival among the not-begun requests its rank speaks for (its dependents: never
      served, so they wait from arrival; inf: none)."""

    arrived_s: float
    work_tokens: int
    began_s: float = math.inf
    served_s: float = 0.0
    waiting_s: float = math.inf

    def waiting_since(self, other_arrived_s: float) -> float:
        """When its aging starts, against a request that arrived at ``other_arrived_s``: arrival, moved later by
        its own service before then (at most the time since it began), or its dependents' arrival if earlier."""
        served_before = min(self.served_s, max(0.0, other_arrived_s - self.began_s))
        return min(self.arrived_s + served_before, self.waiting_s)


class PlanChunk(Protocol):
    """A chunk of a request's plan (`pcr_rag.cache.keys.ChunkSpec`)."""

    @property
    def key(self) -> bytes: ...

    @property
    def num_tokens(self) -> int: ...


class CacheMatch(Protocol):
    """The cache's longest cached prefix of a plan (`pcr_rag.cache.MatchResult`)."""

    @property
    def num_chunks(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class PrefillOutlook:
    """An admitted prefill as the executor ranks it: arrival time (seconds), tokens it still has to compute, the
    plan chunks it would compute and insert (key -> tokens; chunk keys chain, so two prefills that share a chunk
    share everything before it), whether it has begun - a begun prefill is computing those chunks now - and, once
    begun, when it began and the seconds its own steps have run (`Candidate`)."""

    arrived_s: float
    work_tokens: int
    chunks: Mapping[bytes, int]
    begun: bool
    began_s: float = math.inf
    served_s: float = 0.0

    @classmethod
    def not_begun(cls, arrived_s: float, total_tokens: int, plan: Sequence[PlanChunk],
                  match: CacheMatch | None) -> PrefillOutlook:
        """A prefill that has not begun (waiting, or admitted and not yet started): the ``total_tokens`` of its
        prompt less the cache's ``match`` of its ``plan``, and the plan chunks after that match (no chunks, all the
        work, without a cache: ``match`` None). The one definition the scheduler, the executor and the simulator
        share."""
        if match is None:
            return cls(arrived_s, total_tokens, {}, begun=False)
        return cls(arrived_s, total_tokens - match.num_tokens,
                   {c.key: c.num_tokens for c in plan[match.num_chunks:]}, begun=False)


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
    priority per second waited (cache-aware).

    ``cache-aware`` orders by ``work - aging * (now - arrived)``, every prefill's service counted as waiting; if one
    candidate outranks every other pairwise - each pair aged from `Candidate.waiting_since` the other's arrival,
    so service only counts against requests already there while it ran - it goes first. Without service (nothing
    begun: the waiting queue) the two agree, so the pairwise pass is skipped."""
    if schedule == "fcfs":
        return sorted(range(len(candidates)), key=lambda i: (candidates[i].arrived_s, i))
    if schedule != "cache-aware":
        raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")

    def key(i: int, since: float) -> tuple[float, float, int]:
        c = candidates[i]
        return (c.work_tokens - aging * max(0.0, now - since), c.arrived_s, i)

    order = sorted(range(len(candidates)), key=lambda i: key(i, candidates[i].arrived_s))
    if all(c.served_s == 0 for c in candidates):
        return order

    def beats(i: int, j: int) -> bool:
        a, b = candidates[i], candidates[j]
        return key(i, a.waiting_since(b.arrived_s)) < key(j, b.waiting_since(a.arrived_s))

    for pos, i in enumerate(order):
        if all(beats(i, j) for j in order if j != i):
            return [i, *order[:pos], *order[pos + 1:]]
    return order


def prefill_candidates(schedule: str, prefills: Sequence[PrefillOutlook]) -> list[Candidate | None]:
    """How each admitted prefill ranks (`rank`) this step, None for one that must wait: a prefill that has not
    begun and would compute a chunk a begun one is computing waits for it (else the chunk is computed twice).

    A runnable prefill lends nothing and borrows from the not-begun prefills that would reuse chunks it computes
    (its *dependents*; ``residual`` = a dependent's work minus the shared chunks' tokens):
    - arrival: the earliest of its own, its waiting dependents' and those its work counts (aging and ``fcfs``
      then serve the oldest waiting request's group first: priority inheritance);
    - work (``cache-aware``): ``min over k of (own + the k smallest residuals) / (1 + k)``, the group's work per
      request whose TTFT it ends, so a cold prefill that two more requests wait on outranks a lone request with
      half its work, and a shared preamble every request needs does not make them all look alike.
    - service: its own ``began_s`` and ``served_s``, and ``waiting_s`` from the requests its rank speaks for.
    Invariants: without shared chunks every candidate is ``Candidate(arrived_s, work_tokens, began_s, served_s)``;
    a begun prefill is never None, so some prefill can always run."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    computing: set[bytes] = set()
    holders: dict[bytes, list[int]] = {}  # chunk key -> the not-begun prefills that would compute it
    for j, p in enumerate(prefills):
        if p.begun:
            computing.update(p.chunks)
        else:
            for key in p.chunks:
                holders.setdefault(key, []).append(j)
    waiting = [not p.begun and not computing.isdisjoint(p.chunks) for p in prefills]
    out: list[Candidate | None] = []
    for i, p in enumerate(prefills):
        if waiting[i]:
            out.append(None)
            continue
        shared: dict[int, int] = {}  # dependent -> its tokens in chunks p computes (only pairs that share cost)
        for key in p.chunks:
            for j in holders.get(key, ()):
                if j != i:
                    shared[j] = shared.get(j, 0) + prefills[j].chunks[key]
        dependents = sorted((max(0, prefills[j].work_tokens - tokens), prefills[j].arrived_s, waiting[j])
                            for j, tokens in shared.items())  # (residual tokens, arrival, waits on p)
        members = [a for _, a, waits in dependents if waits]  # arrivals of the requests its rank speaks for
        work = float(p.work_tokens)
        if schedule == "cache-aware":
            total, best_k = float(p.work_tokens), 0
            for k, (residual, _, _) in enumerate(dependents, start=1):
                total += residual
                if total / (1 + k) < work:
                    work, best_k = total / (1 + k), k
            members += [a for _, a, _ in dependents[:best_k]]
        out.append(Candidate(min([p.arrived_s, *members]), round(work), p.began_s, p.served_s,
                             min(members, default=math.inf)))
    return out


def queue_candidates(schedule: str, waiting: Sequence[PrefillOutlook], in_flight: Collection[bytes]
                     ) -> list[Candidate]:
    """How each waiting request ranks (`rank`) for the next free row. ``waiting``: the requests' outlooks as if
    admitted now (not begun; chunks = their plan after the cache's match); ``in_flight``: chunk keys that admitted
    prefills will compute.

    A waiting request's work leaves out its chunks in ``in_flight`` (admitted now, it would wait for them and reuse
    them: `prefill_candidates`); then waiting requests that share the remaining chunks rank as a group, as in
    `prefill_candidates` with nothing begun (``cache-aware``: the group's work per request; arrival from the
    requests that work counts). Invariants: with nothing in flight and no shared chunks every candidate is
    ``Candidate(arrived_s, work_tokens)``; under ``fcfs`` every candidate keeps its own arrival (arrival order)."""
    residual = []
    for p in waiting:
        reused = sum(tokens for key, tokens in p.chunks.items() if key in in_flight)
        residual.append(PrefillOutlook(p.arrived_s, max(0, p.work_tokens - reused),
                                       {k: t for k, t in p.chunks.items() if k not in in_flight}, begun=False))
    out = prefill_candidates(schedule, residual)
    assert all(c is not None for c in out), "nothing begun: no prefill waits"
    return [c for c in out if c is not None]


def queue_order(schedule: str, waiting: int, outlook: Callable[[int], PrefillOutlook], in_flight: Collection[bytes],
                now: float, aging: float, horizon: int = ORDER_HORIZON) -> list[int]:
    """Indices ``0 .. waiting - 1`` of the waiting requests (numbered in arrival order) in the order they will be
    admitted: under ``cache-aware`` the `rank` of the `queue_candidates` of the ``horizon`` oldest, then the rest in
    arrival order; under ``fcfs`` arrival order. ``outlook(i)`` (request i's `PrefillOutlook` as if admitted now)
    is asked only of the requests ranked, so a call costs O(horizon^2) whatever the queue's depth."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    head = min(waiting, horizon)
    if schedule == "fcfs" or head < 2:
        return list(range(waiting))
    candidates = queue_candidates(schedule, [outlook(i) for i in range(head)], in_flight)
    return rank(schedule, candidates, now, aging) + list(range(head, waiting))
