"""Bootstrap confidence intervals for the ratios a benchmark report prints.

Design: every system of a run serves the *same* arrival trace, so request ``k`` of system A and request ``k``
of system B are the same question with the same documents at the same arrival time. A ratio such as
``mean TTFT(pcr) / mean TTFT(no-reuse)`` is therefore estimated *paired*: one bootstrap resample draws request
keys (``(repeat, trace index)``) with replacement and evaluates both systems' statistic on the same keys, so the
per-request difficulty (prompt length, position in a queueing burst) cancels and only the systems' difference is
left. The interval is the percentile interval of the resampled ratios.

Statistics (``stat`` names, a dotted path like the report's summaries):

- ``ttft|e2el|queue|tpot`` ``.mean|.p50|.p95|.p99``: over the requests (seconds);
- ``itl.mean|.p50|.p95|.p99``: over the pooled inter-token gaps of the resampled requests;
- ``reuse_ratio`` / ``hit_ratio.<tier>``: reused (by that tier) over prompt tokens, summed over the requests;
- ``throughput_rps``: requests per second. A run's throughput has no per-request value, so it is resampled
  *unpaired*, over the gaps between consecutive completions of each repeat (their mean is 1 / throughput).

What the interval does not cover: requests of one open-loop run share a queue, so their latencies are
correlated; resampling them as independent makes the interval somewhat too narrow. Splitting the requests into
several interleaved repeats (``--repeats``, the ``--standard`` preset) spreads machine drift over all systems.

Pure numpy, deterministic for a given seed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcr_rag.metrics import TIERS

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "CONFIDENCE",
    "RatioInterval",
    "RequestTable",
    "mean_interval",
    "paired_ratio_interval",
    "requests_to_resolve",
    "statistic",
    "throughput_ratio_interval",
]

#: Two-sided confidence level of every interval in a report.
CONFIDENCE = 0.95
#: Bootstrap resamples per interval (percentile method; the 2.5% tails then rest on 50 resamples each).
BOOTSTRAP_RESAMPLES = 2000

_LATENCIES = ("ttft", "e2el", "queue", "tpot")
_AGGREGATES = {"mean": None, "p50": 50.0, "p95": 95.0, "p99": 99.0}


@dataclass(frozen=True)
class RatioInterval:
    """``ratio`` (point estimate on the full paired sample) and its ``[low, high]`` interval at ``confidence``.

    ``n``: paired requests (unpaired: the smaller sample). ``significant``: the interval excludes 1, i.e. the two
    statistics differ at this confidence."""

    ratio: float
    low: float
    high: float
    n: int
    confidence: float = CONFIDENCE
    paired: bool = True

    @property
    def significant(self) -> bool:
        return not (self.low <= 1.0 <= self.high)

    def text(self) -> str:
        """``"0.42x [0.35, 0.50]"``."""
        return f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "n": self.n,
                "confidence": self.confidence, "paired": self.paired, "significant": self.significant}


@dataclass(frozen=True)
class RequestTable:
    """One run's per-request columns (the ``requests`` entry of a report run), keyed by ``(repeat, index)``.

    ``values(col, keys)`` returns the column in the order of ``keys``. Columns: ``ttft``, ``e2el``, ``queue``,
    ``tpot`` (None for one-token answers), ``itl`` (a list per request), ``prompt_tokens``,
    ``reused_<tier>``, ``arrival``."""

    columns: Mapping[str, Sequence[Any]]
    keys: tuple[tuple[int, int], ...]

    @classmethod
    def from_run(cls, run: Mapping[str, Any]) -> RequestTable | None:
        """From a report run dict; None when the run carries no per-request columns."""
        cols = run.get("requests")
        if not cols or not cols.get("ttft"):
            return None
        n = len(cols["ttft"])
        raw = cols.get("key") or [[0, i] for i in range(n)]
        return cls(cols, tuple((int(k[0]), int(k[1])) for k in raw))

    def index(self, keys: Sequence[tuple[int, int]]) -> np.ndarray:
        pos = {k: i for i, k in enumerate(self.keys)}
        return np.fromiter((pos[k] for k in keys), dtype=np.int64, count=len(keys))


# A statistic on a table: (table, rows as a (resamples, n) matrix of row indices) -> one value per resample.
Statistic = Callable[[RequestTable, np.ndarray], np.ndarray]


def _column(table: RequestTable, name: str) -> np.ndarray:
    return np.asarray([math.nan if v is None else float(v) for v in table.columns[name]], dtype=np.float64)


def _aggregate(values: np.ndarray, agg: str) -> np.ndarray:
    """Row-wise aggregate of a (resamples, n) matrix, ignoring NaN (linear percentiles, like `percentile`)."""
    q = _AGGREGATES[agg]
    with warnings.catch_warnings():  # an all-NaN row (no defined value) gives NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=1) if q is None else np.nanpercentile(values, q, axis=1)


def statistic(name: str) -> Statistic:
    """The bootstrap statistic called ``name`` (see the module docstring); ValueError for an unknown name."""
    head, _, agg = name.partition(".")
    if head in _LATENCIES and agg in _AGGREGATES:
        def latency(table: RequestTable, rows: np.ndarray) -> np.ndarray:
            return _aggregate(_column(table, head)[rows], agg)

        return latency
    if head == "itl" and agg in _AGGREGATES:
        def itl(table: RequestTable, rows: np.ndarray) -> np.ndarray:
            lists = [np.asarray(x or (), dtype=np.float64) for x in table.columns["itl"]]
            lens = np.asarray([len(x) for x in lists], dtype=np.int64)
            flat = np.concatenate(lists) if lists else np.zeros(0)
            q = _AGGREGATES[agg]
            out = np.empty(rows.shape[0])
            for r, row in enumerate(rows):
                counts = np.bincount(row, minlength=len(lists))
                pooled = np.repeat(flat, np.repeat(counts, lens))
                if pooled.size == 0:
                    out[r] = math.nan
                else:
                    out[r] = pooled.mean() if q is None else np.percentile(pooled, q)
            return out

        return itl
    if name == "reuse_ratio" or (head == "hit_ratio" and agg in TIERS):
        tiers = TIERS if name == "reuse_ratio" else (agg,)

        def ratio_of_sums(table: RequestTable, rows: np.ndarray) -> np.ndarray:
            reused = sum(_column(table, f"reused_{t}") for t in tiers)
            prompt = _column(table, "prompt_tokens")
            den = prompt[rows].sum(axis=1)
            with np.errstate(all="ignore"):
                return np.where(den > 0, reused[rows].sum(axis=1) / np.where(den > 0, den, 1.0), math.nan)

        return ratio_of_sums
    raise ValueError(f"no bootstrap statistic {name!r}; use ttft/e2el/queue/tpot/itl + .mean/.p50/.p95/.p99, "
                     "reuse_ratio, hit_ratio.<tier> or throughput_rps")


def _interval(point: float, samples: np.ndarray, n: int, confidence: float, paired: bool) -> RatioInterval | None:
    finite = samples[np.isfinite(samples)]
    if not math.isfinite(point) or finite.size < max(10, samples.size // 2):
        return None
    alpha = 1.0 - confidence
    low, high = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return RatioInterval(float(point), float(low), float(high), n, confidence, paired)


def paired_ratio_interval(
    a: RequestTable, b: RequestTable, stat: str, *, baseline_stat: str | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0,
) -> RatioInterval | None:
    """``stat(a) / baseline_stat(b)`` (``baseline_stat`` defaults to ``stat``) over the requests both tables
    hold, with a paired percentile-bootstrap interval. None when fewer than 2 requests pair up or the
    statistic is undefined (e.g. a zero denominator)."""
    if stat == "throughput_rps":
        return throughput_ratio_interval(a, b, resamples=resamples, confidence=confidence, seed=seed)
    fa, fb = statistic(stat), statistic(baseline_stat or stat)
    keys = sorted(set(a.keys) & set(b.keys))
    n = len(keys)
    if n < 2:
        return None
    ia, ib = a.index(keys), b.index(keys)
    full = np.arange(n)[None, :]
    with np.errstate(all="ignore"):
        point = float((fa(a, ia[full]) / fb(b, ib[full]))[0])
        draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
        ratios = fa(a, ia[draws]) / fb(b, ib[draws])
    return _interval(point, ratios, n, confidence, paired=True)


def mean_interval(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                  seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval ``(low, high)`` of the mean of ``values`` (one run's requests, resampled with
    replacement): how far the mean could move with other requests of the same kind. None for fewer than 2 finite
    values. Like every interval here, it does not cover the machine's drift between runs."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size < 2:
        return None
    means = x[np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _completion_gaps(table: RequestTable) -> np.ndarray:
    """Per repeat: completion times (arrival + e2el) sorted, gaps from the repeat's first arrival."""
    arrival = _column(table, "arrival") if "arrival" in table.columns else np.zeros(len(table.keys))
    done = arrival + _column(table, "e2el")
    gaps: list[np.ndarray] = []
    reps = np.asarray([k[0] for k in table.keys])
    for rep in sorted(set(reps.tolist())):
        sel = reps == rep
        times = np.sort(done[sel])
        gaps.append(np.diff(np.concatenate([[arrival[sel].min()], times])))
    return np.concatenate(gaps) if gaps else np.zeros(0)


def throughput_ratio_interval(
    a: RequestTable, b: RequestTable, *, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
    seed: int = 0,
) -> RatioInterval | None:
    """Throughput of ``a`` over throughput of ``b`` (requests/s; each = 1 / mean gap between completions),
    with an unpaired bootstrap over each run's completion gaps."""
    ga, gb = _completion_gaps(a), _completion_gaps(b)
    if ga.size < 2 or gb.size < 2 or ga.sum() <= 0 or gb.sum() <= 0:
        return None
    rng = np.random.default_rng(seed)
    ma = ga[rng.integers(0, ga.size, size=(resamples, ga.size))].mean(axis=1)
    mb = gb[rng.integers(0, gb.size, size=(resamples, gb.size))].mean(axis=1)
    with np.errstate(all="ignore"):
        ratios = mb / ma
    return _interval(float(gb.mean() / ga.mean()), ratios, min(ga.size, gb.size), confidence, paired=False)


def requests_to_resolve(a: Sequence[float], b: Sequence[float], *, difference: float = 0.10,
                        z_confidence: float = 1.96, z_power: float = 0.84) -> int:
    """Paired requests needed so that a true ``mean(a) / mean(b)`` of ``1 - difference`` gives an interval whose
    upper end stays below 1 with 80% power (``z_power`` = 0.84), at 95% confidence (``z_confidence``).

    From a pilot's paired per-request values (seconds): by the delta method the ratio's standard error is
    ``sd(a_i - R b_i) / (sqrt(n) mean(b))``, so ``n = ((z_c + z_p) sd / (difference mean(b)))^2``."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape or xa.size < 2:
        raise ValueError("need two paired samples of equal length >= 2")
    r = xa.mean() / xb.mean()
    sd = float(np.std(xa - r * xb, ddof=1))
    return max(2, math.ceil(((z_confidence + z_power) * sd / (difference * xb.mean())) ** 2))
