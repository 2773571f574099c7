"""The shared benchmark report of `pcr-rag bench` and `pcr-rag simulate`: JSON, Markdown, PNG plots, one-liners.

JSON layout (stable keys; times in seconds, ratios as fractions, sizes in bytes / tokens)::

    {"schema": "pcr-rag-report/1", "kind": "bench" | "simulate", "created_utc": "...",
     "config": {...}, "environment": {...},
     "runs": [{"system": "pcr", "rate": 0.5,                  # req/s; the string "inf" = all at once
               "num_requests": n, "repeats": r, "duration_s": s,
               "ttft": {"mean", "p50", "p95", "p99"}, "e2el": {...}, "itl": {...}, "tpot": {...},
               "queue": {...}, "prefill": {...}, "prefill_compute": {...},
               "hit_ratio": {"device", "dram", "ssd"}, "reuse_ratio": f,
               "tokens": {"prompt", "computed", "reused", "output"},
               "throughput_rps": x, "output_tokens_per_s": x, "prefetch_hits": n,
               "bytes": {...}, "extra": {...},
               "requests": {"key": [[repeat, index], ...], "ttft": [...], ...}}, ...],   # per request
     "summary": "pcr: mean TTFT ... (one line)", "breakdown": [...], "targets": [...],
     "ratios": [{"system", "baseline", "stat", "rate", "ratio", "low", "high", "n", "significant"}, ...],
     "answers": [{"system", "baseline", "rate", "equal", "n", "hit", "checked"}, ...],
     "aliases": {"name": "system whose runs it shares"}, "skipped": [{"system", "reason"}],
     "limit_ratio": {...} | null, "notes": [...]}

A latency summary whose sample is empty has ``null`` values. Percentiles are linear-interpolated
(:func:`pcr_rag.metrics.percentile`, numpy's default method), the one implementation used everywhere.

Every ratio (targets, the ``ratios`` table, the breakdown, the summary line) carries a 95% bootstrap interval
over requests, paired by ``(repeat, trace index)`` (`pcr_rag.bench.stats`); a target is judged on the interval's
unfavourable end, and a ratio whose interval holds 1 is flagged as not significant.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pcr_rag.bench.stats import RatioInterval, RequestTable, paired_ratio_interval
from pcr_rag.bench.targets import RatioTarget
from pcr_rag.bench.trace_bounds import bounds_markdown
from pcr_rag.metrics import TIERS, percentile, summarize

__all__ = [
    "SCHEMA",
    "RequestSample",
    "answer_rows",
    "RunRecord",
    "TargetResult",
    "breakdown",
    "build_report",
    "evaluate_targets",
    "format_seconds",
    "latency_summary",
    "load_report",
    "markdown_report",
    "mid_rate",
    "percentile",
    "rates",
    "ratio_interval",
    "ratio_rows",
    "run_for",
    "user_summary",
    "write_json",
    "write_markdown",
    "write_plots",
    "write_report",
]

SCHEMA = "pcr-rag-report/1"
LATENCY_KEYS = ("mean", "p50", "p95", "p99")
#: The PCR variants of the Table-1-like breakdown: (system without the mechanism, mechanism name).
ABLATIONS: tuple[tuple[str, str], ...] = (
    ("pcr-no-overlap", "layer-wise overlap"),
    ("pcr-no-prefetch", "queue prefetch"),
    ("pcr-lru", "look-ahead eviction"),
)


# ------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RequestSample:
    """What one measured request cost. Seconds from its arrival (submission); tokens.

    ``reused_by_tier`` maps ``"device"/"dram"/"ssd"`` to prompt tokens whose KV came from that tier (the exact
    prefix); ``blended_tokens``: blend mode's placed tokens as the engine counts them (approximate KV);
    ``computed_tokens + sum(reused_by_tier) + blended_tokens == prompt_tokens``. A blend request also carries
    what the bench's `pcr_rag.bench.blend_ledger` made of it: ``blended_reused`` (placed tokens whose KV an earlier
    request left: reuse) and ``blended_fresh`` (placed tokens whose KV was computed in isolation for this request:
    not reuse), both None when the ledger could not replay its plan;
    ``compute_context`` (sum of ``position + 1/2`` over every position it computed, fresh ones included: the
    context term of a raw forward of exactly those tokens) and ``compute_spans`` (forward spans computed in
    context); None for other requests. ``itl_s``: gaps between generated tokens.
    ``key``: ``(repeat, trace index)``, what pairs this request with the same request of another system (None:
    its position in the run). ``arrival_s``: its arrival time in the trace. ``output_hash``: a digest of the
    generated token ids (equal answers, equal hashes). ``answer_hit``: whether the answer names what the
    question asked about (retrieval workload with gold passages; None otherwise). ``prefill_s``,
    ``prefill_compute_s``, ``load_wait_s``: as in `pcr_rag.metrics.RequestMetrics` (its time holding a row
    before the first token, the part its own steps ran, the part of that waiting for KV).
    """

    ttft_s: float
    e2e_s: float
    queue_s: float
    itl_s: tuple[float, ...]
    prompt_tokens: int
    computed_tokens: int
    reused_by_tier: Mapping[str, int]
    output_tokens: int
    prefetch_hit_chunks: int = 0
    key: tuple[int, int] | None = None
    arrival_s: float = 0.0
    output_hash: str | None = None
    answer_hit: bool | None = None
    prefill_s: float = 0.0
    prefill_compute_s: float = 0.0
    load_wait_s: float = 0.0
    blended_tokens: int = 0
    blended_reused: int | None = None
    blended_fresh: int | None = None
    compute_context: float | None = None
    compute_spans: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, ``(e2e - ttft) / (output_tokens - 1)``; None for one token."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_metrics(cls, metrics: Any, output_tokens: int | None = None, **fields: Any) -> RequestSample:
        """From a runtime `RequestMetrics` (duck-typed: the fields named in DESIGN.md); ``fields`` sets the
        pairing and answer fields (``key``, ``arrival_s``, ``output_hash``, ``answer_hit``)."""
        itl = tuple(float(x) for x in (getattr(metrics, "itl_s", None) or ()))
        out = output_tokens if output_tokens is not None else getattr(metrics, "generated_tokens", len(itl) + 1)
        by_tier = dict(getattr(metrics, "reused_by_tier", None) or {})
        return cls(
            ttft_s=float(metrics.ttft_s),
            e2e_s=float(metrics.e2e_s),
            queue_s=float(getattr(metrics, "queue_s", 0.0)),
            itl_s=itl,
            prompt_tokens=int(metrics.prompt_tokens),
            computed_tokens=int(metrics.computed_tokens),
            reused_by_tier={t: int(by_tier.get(t, 0)) for t in TIERS},
            output_tokens=int(out),
            prefetch_hit_chunks=int(getattr(metrics, "prefetch_hit_chunks", 0)),
            prefill_s=float(getattr(metrics, "prefill_s", 0.0)),
            prefill_compute_s=float(getattr(metrics, "prefill_compute_s", 0.0)),
            load_wait_s=float(getattr(metrics, "load_wait_s", 0.0)),
            blended_tokens=int(getattr(metrics, "blended_tokens", 0) or 0),
            **fields,
        )


@dataclass
class RunRecord:
    """All measured requests of one system at one request rate (repeats concatenated).

    ``duration_s``: wall (or virtual) time from the first arrival to the last completion, summed over repeats;
    throughput = requests / duration. ``bytes``: per-run byte counters (names say what they count).
    ``extra``: anything system-specific worth keeping (prefetch window, load factor, eviction, ...).
    """

    system: str
    rate: float
    samples: list[RequestSample] = field(default_factory=list)
    duration_s: float = 0.0
    repeats: int = 1
    prefetch_hits: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def merge(self, other: RunRecord) -> None:
        """Add another repeat of the same (system, rate): samples appended, durations and counters summed."""
        if (other.system, other.rate) != (self.system, self.rate):
            raise ValueError(f"cannot merge {other.system}@{other.rate} into {self.system}@{self.rate}")
        self.samples.extend(other.samples)
        self.duration_s += other.duration_s
        self.repeats += other.repeats
        self.prefetch_hits += other.prefetch_hits
        for k, v in other.bytes.items():
            self.bytes[k] = self.bytes.get(k, 0) + v
        for k, v in other.extra.items():
            self.extra.setdefault(k, v)

    def to_dict(self) -> dict[str, Any]:
        s = self.samples
        prompt = sum(x.prompt_tokens for x in s)
        by_tier = {t: sum(x.reused_by_tier.get(t, 0) for x in s) for t in TIERS}
        reused = sum(by_tier.values())
        output = sum(x.output_tokens for x in s)
        return {
            "system": self.system,
            "rate": _rate_to_json(self.rate),
            "num_requests": len(s),
            "repeats": self.repeats,
            "duration_s": self.duration_s,
            "ttft": latency_summary([x.ttft_s for x in s]),
            "e2el": latency_summary([x.e2e_s for x in s]),
            "itl": latency_summary([g for x in s for g in x.itl_s]),
            "tpot": latency_summary([x.tpot_s for x in s if x.tpot_s is not None]),
            "queue": latency_summary([x.queue_s for x in s]),
            "prefill": latency_summary([x.prefill_s for x in s]),
            "prefill_compute": latency_summary([x.prefill_compute_s for x in s]),
            "hit_ratio": {t: (by_tier[t] / prompt if prompt else 0.0) for t in TIERS},
            "reuse_ratio": reused / prompt if prompt else 0.0,
            "tokens": {"prompt": prompt, "computed": sum(x.computed_tokens for x in s), "reused": reused,
                       "output": output, **_blend_tokens(s)},
            "throughput_rps": len(s) / self.duration_s if self.duration_s > 0 else None,
            "output_tokens_per_s": output / self.duration_s if self.duration_s > 0 else None,
            "prefetch_hits": self.prefetch_hits,
            "bytes": dict(self.bytes),
            "extra": _jsonable(self.extra),
            "requests": _request_columns(s),
        }


def _blend_tokens(samples: Sequence[RequestSample]) -> dict[str, Any]:
    """A run's blend token counts (empty for a run no blend ledger saw): ``blended`` (the engine's count),
    ``blended_reused`` (placed from KV an earlier request left) and ``blended_fresh`` (placed after an isolated
    prefill for the request itself), each None when some request's plan could not be replayed."""
    ledgered = [x for x in samples if x.compute_context is not None]
    if not ledgered and not any(x.blended_tokens for x in samples):
        return {}
    known = all(x.blended_reused is not None and x.blended_fresh is not None for x in ledgered) and bool(ledgered)
    return {"blended": sum(x.blended_tokens for x in samples),
            "blended_reused": sum(x.blended_reused or 0 for x in ledgered) if known else None,
            "blended_fresh": sum(x.blended_fresh or 0 for x in ledgered) if known else None}


def _request_columns(samples: Sequence[RequestSample]) -> dict[str, list[Any]]:
    """The per-request columns the bootstrap intervals are computed from (see `pcr_rag.bench.stats`)."""
    return {
        "key": [list(x.key) if x.key is not None else [0, i] for i, x in enumerate(samples)],
        "arrival": [x.arrival_s for x in samples],
        "ttft": [x.ttft_s for x in samples],
        "e2el": [x.e2e_s for x in samples],
        "queue": [x.queue_s for x in samples],
        "prefill": [x.prefill_s for x in samples],
        "prefill_compute": [x.prefill_compute_s for x in samples],
        "load_wait": [x.load_wait_s for x in samples],
        "tpot": [x.tpot_s for x in samples],
        "itl": [list(x.itl_s) for x in samples],
        "prompt_tokens": [x.prompt_tokens for x in samples],
        **{f"reused_{t}": [x.reused_by_tier.get(t, 0) for x in samples] for t in TIERS},
        "output_tokens": [x.output_tokens for x in samples],
        "output_hash": [x.output_hash for x in samples],
        "answer_hit": [x.answer_hit for x in samples],
        "blended": [x.blended_tokens for x in samples],
        "blended_reused": [x.blended_reused for x in samples],
        "blended_fresh": [x.blended_fresh for x in samples],
        "compute_context": [x.compute_context for x in samples],
        "compute_spans": [x.compute_spans for x in samples],
    }


def latency_summary(values: Sequence[float]) -> dict[str, float | None]:
    """``{"mean", "p50", "p95", "p99"}`` of ``values`` (seconds); every value None when ``values`` is empty."""
    out = summarize(list(values))
    return {k: (None if math.isnan(out[k]) else float(out[k])) for k in LATENCY_KEYS}


def _rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else float(rate)


def _rate_from_json(rate: Any) -> float:
    return math.inf if rate in ("inf", "Infinity", None) else float(rate)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


# ------------------------------------------------------------------------------------------ report queries


def rates(report: Mapping[str, Any]) -> list[float]:
    """Distinct request rates of the report's runs, ascending (inf last)."""
    return sorted({_rate_from_json(r["rate"]) for r in report["runs"]})


def mid_rate(report: Mapping[str, Any]) -> float:
    """The middle rate of the sweep (the lower middle for an even count); targets are judged there."""
    rs = [r for r in rates(report) if not math.isinf(r)] or rates(report)
    if not rs:
        raise ValueError("the report has no runs")
    return rs[(len(rs) - 1) // 2]


def run_for(report: Mapping[str, Any], system: str, rate: float) -> dict[str, Any] | None:
    """The run dict of ``system`` at ``rate`` (matched within 1e-9 relative), or None. A name in the report's
    ``aliases`` (a system with the same configuration as another, run once) resolves to that system."""
    system = (report.get("aliases") or {}).get(system, system)
    for r in report["runs"]:
        rr = _rate_from_json(r["rate"])
        if r["system"] == system and (rr == rate or math.isclose(rr, rate, rel_tol=1e-9)):
            return r
    return None


def _stat(run: Mapping[str, Any] | None, stat: str) -> float | None:
    """``"ttft.mean"``-style lookup; None when missing."""
    if run is None:
        return None
    obj: Any = run
    for part in stat.split("."):
        if not isinstance(obj, Mapping) or part not in obj:
            return None
        obj = obj[part]
    return None if obj is None else float(obj)


def format_seconds(x: float | None) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``2.5`` -> ``"2.50 s"``; None -> ``"n/a"``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if abs(x) < 1.0:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def _fmt_rate(rate: float) -> str:
    return "all-at-once" if math.isinf(rate) else f"{rate:.3g} req/s"


# ---------------------------------------------------------------------------------------------- targets


def ratio_interval(run: Mapping[str, Any] | None, baseline: Mapping[str, Any] | None, stat: str, *,
                   baseline_stat: str | None = None) -> RatioInterval | None:
    """``stat(run) / baseline_stat(baseline)`` with its paired bootstrap interval, from the runs' per-request
    columns; None when a run is missing, carries no per-request data, or the ratio is undefined."""
    if run is None or baseline is None:
        return None
    a, b = RequestTable.from_run(run), RequestTable.from_run(baseline)
    if a is None or b is None:
        return None
    return paired_ratio_interval(a, b, stat, baseline_stat=baseline_stat)


@dataclass(frozen=True)
class TargetResult:
    """How a target fared: ``ratio`` is None (and ``passed`` False) when a needed run is missing.

    ``ci_low``/``ci_high``: the ratio's 95% bootstrap interval (None without per-request data); ``passed`` is
    judged on its unfavourable end (upper for ``max_ratio``, lower for ``min_ratio``), else on the ratio."""

    name: str
    system: str
    baseline: str
    stat: str
    rate: float
    value: float | None
    baseline_value: float | None
    ratio: float | None
    max_ratio: float
    passed: bool
    min_ratio: float | None = None
    baseline_stat: str | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    significant: bool | None = None
    n: int | None = None
    missing: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self.__dict__)

    def line(self) -> str:
        if self.ratio is None:
            return (f"[NOT RUN] {self.name}: not measured "
                    f"({self.missing or f'{self.system} or {self.baseline} missing'})")
        verdict = "PASS" if self.passed else "MISS"
        bstat = self.baseline_stat or self.stat
        if self.min_ratio is not None:
            goal, end = f">= {self.min_ratio:.2f}x", "lower"
        else:
            goal, end = f"<= {self.max_ratio:.2f}x", "upper"
        if self.ci_low is None or self.ci_high is None:
            interval = " (no interval: judged on the point ratio)"
        else:
            interval = (f" [{self.ci_low:.2f}, {self.ci_high:.2f}] (95% CI, n={self.n}; judged at the {end} end"
                        f"{'' if self.significant else '; difference not significant'})")
        return (f"[{verdict}] {self.name}: {self.system} {self.stat} {_fmt_value(self.stat, self.value)} / "
                f"{self.baseline} {bstat} {_fmt_value(bstat, self.baseline_value)} = {self.ratio:.2f}x{interval}; "
                f"target {goal} at {_fmt_rate(self.rate)}")


def _fmt_value(stat: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if stat == "reuse_ratio" or stat.startswith("hit_ratio"):
        return f"{value:.1%}"
    if stat == "throughput_rps":
        return f"{value:.3g} req/s"
    return format_seconds(value)


def evaluate_targets(
    report: Mapping[str, Any], targets: Iterable[RatioTarget], rate: float | None = None
) -> list[TargetResult]:
    """Judge each target at ``rate`` (default: :func:`mid_rate`) from the report's measured runs only."""
    at = mid_rate(report) if rate is None else rate
    skipped = {s["system"]: s["reason"] for s in report.get("skipped") or []}
    out: list[TargetResult] = []
    for t in targets:
        run, base = run_for(report, t.system, at), run_for(report, t.baseline, at)
        missing = "; ".join(f"{n} skipped: {skipped[n]}" if n in skipped else f"{n} not run at this rate"
                            for n, r in ((t.system, run), (t.baseline, base)) if r is None) or None
        v = _stat(run, t.stat)
        b = _stat(base, t.baseline_stat or t.stat)
        ratio = v / b if (v is not None and b) else None
        ci = ratio_interval(run, base, t.stat, baseline_stat=t.baseline_stat) if ratio is not None else None
        if ci is not None:
            ratio = ci.ratio
        if ratio is None:
            passed = False
        elif t.min_ratio is not None:
            passed = (ci.low if ci else ratio) >= t.min_ratio
        else:
            passed = (ci.high if ci else ratio) <= t.max_ratio
        out.append(TargetResult(t.name, t.system, t.baseline, t.stat, at, v, b, ratio, t.max_ratio, passed,
                                t.min_ratio, t.baseline_stat, ci.low if ci else None, ci.high if ci else None,
                                ci.significant if ci else None, ci.n if ci else None, missing))
    return out


def ratio_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report's ratio table: at every rate, pcr (or the first system) over every other system for mean and
    P99 TTFT, over each ``@order`` twin also for the hit ratio, and at saturation the throughput of each
    ``pcr-max-active-N`` over the smallest N; each with its interval (``low``/``high`` None without one)."""
    rows: list[dict[str, Any]] = []
    for rate in rates(report):
        runs = [r for r in report["runs"] if _rate_from_json(r["rate"]) == rate]
        names = [r["system"] for r in runs]
        pairs: list[tuple[str, str, str]] = []
        active = sorted((n for n in names if n.startswith("pcr-max-active-")),
                        key=lambda n: int(n.removeprefix("pcr-max-active-")))
        pairs += [(n, active[0], "throughput_rps") for n in active[1:]]
        ref = "pcr" if "pcr" in names else (names[0] if names and not active else None)
        if ref is not None:
            for other in names:
                if other == ref:
                    continue
                pairs += [(ref, other, "ttft.mean"), (ref, other, "ttft.p99")]
                if "@" in other or "@" in ref:
                    pairs.append((ref, other, "reuse_ratio"))
        for system, baseline, stat in pairs:
            run, base = run_for(report, system, rate), run_for(report, baseline, rate)
            v, b = _stat(run, stat), _stat(base, stat)
            ci = ratio_interval(run, base, stat)
            ratio = ci.ratio if ci else (v / b if v is not None and b else None)
            rows.append({"rate": _rate_to_json(rate), "system": system, "baseline": baseline, "stat": stat,
                         "value": v, "baseline_value": b, "ratio": ratio,
                         "low": ci.low if ci else None, "high": ci.high if ci else None,
                         "n": ci.n if ci else None, "significant": ci.significant if ci else None})
    return rows


def answer_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Answer agreement at every rate: each system against ``no-reuse`` (same prompt, same greedy tokens
    expected from an exact cache), and each ``X@order`` system against ``X`` (a different document order is a
    different prompt): ``equal`` of ``n`` paired requests generated the same tokens. ``hit``/``checked``: the
    system's answers that name what a generated question asked about (None without gold questions)."""
    rows: list[dict[str, Any]] = []
    for rate in rates(report):
        runs = {r["system"]: r for r in report["runs"] if _rate_from_json(r["rate"]) == rate}
        pairs = [(n, "no-reuse") for n in runs if n != "no-reuse" and "no-reuse" in runs]
        pairs += [(n, n.split("@", 1)[0]) for n in runs if "@" in n]
        for system, baseline in dict.fromkeys(pairs):
            a, b = runs[system], run_for(report, baseline, rate)
            if b is None or b is a:
                continue
            ha = _hashes(a)
            hb = _hashes(b)
            keys = [k for k in ha if k in hb and ha[k] is not None and hb[k] is not None]
            hits = [h for h in (a.get("requests") or {}).get("answer_hit", []) if h is not None]
            if not keys and not hits:  # no answers recorded (e.g. a simulation)
                continue
            rows.append({"rate": _rate_to_json(rate), "system": system, "baseline": baseline,
                         "equal": sum(ha[k] == hb[k] for k in keys), "n": len(keys),
                         "hit": sum(hits) if hits else None, "checked": len(hits) if hits else None})
    return rows


def _hashes(run: Mapping[str, Any]) -> dict[tuple[int, int], str | None]:
    cols = run.get("requests") or {}
    return {tuple(k): h for k, h in zip(cols.get("key", []), cols.get("output_hash", []), strict=False)}


# --------------------------------------------------------------------------------------------- breakdown


def breakdown(report: Mapping[str, Any], rate: float, *, stat: str = "ttft.mean") -> list[dict[str, Any]]:
    """Table-1-like contribution of each PCR mechanism at ``rate``: for every ablation present,
    ``reduction = (stat(without) - stat(pcr)) / stat(without)`` (positive = the mechanism helps), with its
    interval ``[reduction_low, reduction_high]`` (1 - the paired interval of pcr / without; None without one).

    Also ``pcr`` against ``ssd-on-demand`` (all mechanisms together), when both ran."""
    pcr_run = run_for(report, "pcr", rate)
    pcr = _stat(pcr_run, stat)
    rows: list[dict[str, Any]] = []
    pairs = [*ABLATIONS, ("ssd-on-demand", "all PCR mechanisms (vs ssd-on-demand)")]
    for system, mechanism in pairs:
        other = run_for(report, system, rate)
        without = _stat(other, stat)
        if pcr is None or without is None:
            continue
        ci = ratio_interval(pcr_run, other, stat)
        rows.append({
            "rate": _rate_to_json(rate), "mechanism": mechanism, "without": system, "stat": stat,
            "value_without": without, "value_pcr": pcr,
            "reduction": (without - pcr) / without if without else None,
            "reduction_low": 1 - ci.high if ci else None, "reduction_high": 1 - ci.low if ci else None,
            "significant": ci.significant if ci else None,
        })
    return rows


def user_summary(report: Mapping[str, Any], rate: float | None = None, *, system: str = "pcr",
                 baselines: Sequence[str] = ("no-reuse", "dram-only", "ssd-on-demand", "transformers",
                                             "llama-cpp")) -> str:
    """One line a user would care about, of the form ``"at R req/s, pcr: mean TTFT A s vs no-reuse B s (Nx
    faster [lo-hi]), P99 C s vs D s (Mx [...]); ..."`` (speed-ups with their 95% intervals, "n.s." when the
    interval holds 1). Only numbers from the report; missing runs are left out."""
    at = mid_rate(report) if rate is None else rate
    ours = run_for(report, system, at)
    if ours is None:
        return f"{system} was not run at {_fmt_rate(at)}"
    parts: list[str] = []
    for base in baselines:
        theirs = run_for(report, base, at)
        if theirs is None:
            continue
        m, bm = _stat(ours, "ttft.mean"), _stat(theirs, "ttft.mean")
        p, bp = _stat(ours, "ttft.p99"), _stat(theirs, "ttft.p99")
        cm, cp = ratio_interval(ours, theirs, "ttft.mean"), ratio_interval(ours, theirs, "ttft.p99")
        parts.append(f"mean TTFT {format_seconds(m)} vs {base} {format_seconds(bm)} ({_speedup(bm, m, cm)}), "
                     f"P99 {format_seconds(p)} vs {format_seconds(bp)} ({_speedup(bp, p, cp)})")
    if not parts:
        return f"at {_fmt_rate(at)}, {system}: mean TTFT {format_seconds(_stat(ours, 'ttft.mean'))}"
    return f"at {_fmt_rate(at)}, {system}: " + "; ".join(parts)


def _speedup(base: float | None, ours: float | None, ci: RatioInterval | None = None) -> str:
    if base is None or ours is None or ours <= 0:
        return "n/a"
    x = base / ours
    text = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
    if ci is None or ci.low <= 0:
        return text
    lo, hi = (1 / ci.high, 1 / ci.low) if x >= 1 else (ci.low, ci.high)
    return f"{text} [{lo:.2f}-{hi:.2f}]{'' if ci.significant else ', n.s.'}"


# ------------------------------------------------------------------------------------------------ build


def build_report(
    runs: Iterable[RunRecord],
    *,
    kind: str,
    config: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
    targets: Iterable[RatioTarget] = (),
    target_rate: float | None = None,
    limit_ratio: Mapping[str, Any] | None = None,
    notes: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
    skipped: Mapping[str, str] | None = None,
    caveat: str | None = None,
) -> dict[str, Any]:
    """Assemble the report dict (see the module docstring). Runs with the same (system, rate) are merged.

    ``aliases``: system name -> the system whose runs it shares (same configuration, run once); ``skipped``:
    system name -> why it did not run; ``caveat``: a line the Markdown prints first (e.g. "indicative only")."""
    merged: dict[tuple[str, float], RunRecord] = {}
    for run in runs:
        key = (run.system, run.rate)
        if key in merged:
            merged[key].merge(run)
        else:
            merged[key] = RunRecord(run.system, run.rate, list(run.samples), run.duration_s, run.repeats,
                                    run.prefetch_hits, dict(run.bytes), dict(run.extra))
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": kind,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": _jsonable(dict(config or {})),
        "environment": _jsonable(dict(environment or default_environment())),
        "runs": [r.to_dict() for r in _ordered(merged)],
        "aliases": dict(aliases or {}),
        "skipped": [{"system": k, "reason": v} for k, v in (skipped or {}).items()],
        "caveat": caveat,
    }
    if not report["runs"]:
        report.update(summary="no runs", breakdown=[], targets=[], ratios=[], answers=[],
                      limit_ratio=_jsonable(limit_ratio),
                      notes=list(notes))
        return report
    at = mid_rate(report) if target_rate is None else target_rate
    report["target_rate"] = _rate_to_json(at)
    report["summary"] = user_summary(report, at)
    report["breakdown"] = [row for r in rates(report) for row in breakdown(report, r)]
    report["targets"] = [t.as_dict() for t in evaluate_targets(report, targets, at)]
    report["ratios"] = _jsonable(ratio_rows(report))
    report["answers"] = answer_rows(report)
    report["limit_ratio"] = _jsonable(limit_ratio) if limit_ratio is not None else None
    report["notes"] = list(notes)
    return report


def _ordered(merged: Mapping[tuple[str, float], RunRecord]) -> list[RunRecord]:
    """Runs by rate (ascending, inf last), then systems in the order they first appeared."""
    order = {name: i for i, name in enumerate(dict.fromkeys(system for system, _ in merged))}
    return [merged[k] for k in sorted(merged, key=lambda k: (k[1], order[k[0]]))]


def default_environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "machine": platform.machine()}


def write_json(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the report as strict JSON (no NaN/Infinity), atomically. Returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(p)
    return p


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a report written by :func:`write_json`; raises ValueError when it is not one."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path} is not a pcr-rag report (schema {SCHEMA})")
    return data


# --------------------------------------------------------------------------------------------- markdown


def markdown_report(report: Mapping[str, Any], *, title: str | None = None) -> str:
    """A Markdown page: per-rate latency tables, hit ratios, breakdown, targets, limit ratio, notes."""
    lines = [f"# {title or ('pcr-rag ' + str(report.get('kind', 'bench')))} report", ""]
    if report.get("caveat"):
        lines += [f"> **{report['caveat']}**", ""]
    if report.get("summary"):
        lines += [f"**{report['summary']}**", ""]
    cfg = report.get("config") or {}
    if cfg:
        lines += ["Configuration: " + ", ".join(f"`{k}={_short(v)}`" for k, v in cfg.items()), ""]
    header = ("| system | TTFT mean | P50 | P95 | P99 | E2EL mean | E2EL P99 | TPOT mean | ITL P99 | queue mean "
              "| hit DRAM | hit SSD | hit dev | req/s done | prefetch hits |")
    sep = "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"
    for rate in rates(report):
        runs = [r for r in report["runs"] if _rate_from_json(r["rate"]) == rate]
        lines += [f"## {_fmt_rate(rate)}", "", header, sep]
        for r in runs:
            lines.append(
                f"| {r['system']} | {format_seconds(r['ttft']['mean'])} | {format_seconds(r['ttft']['p50'])} "
                f"| {format_seconds(r['ttft']['p95'])} | {format_seconds(r['ttft']['p99'])} "
                f"| {format_seconds(r['e2el']['mean'])} | {format_seconds(r['e2el']['p99'])} "
                f"| {format_seconds(r['tpot']['mean'])} | {format_seconds(r['itl']['p99'])} "
                f"| {format_seconds(r['queue']['mean'])} | {r['hit_ratio']['dram']:.1%} "
                f"| {r['hit_ratio']['ssd']:.1%} | {r['hit_ratio']['device']:.1%} "
                f"| {_num(r.get('throughput_rps'))} | {r.get('prefetch_hits', 0)} |"
            )
        lines.append("")
    skipped = report.get("skipped") or []
    aliases = report.get("aliases") or {}
    same = {a: b for a, b in aliases.items() if a.split("@", 1)[0] != b}
    in_order = [a for a in aliases if a not in same]
    if skipped or same:
        lines += ["## Systems not run", ""]
        lines += [f"- `{s['system']}` skipped: {s['reason']}" for s in skipped]
        lines += [f"- `{a}` has the same configuration as `{b}`: run once, its figures are `{b}`'s"
                  for a, b in same.items()]
        lines.append("")
    if in_order:
        lines += [f"Document order of the cached systems: {', '.join(f'`{a}` is `{aliases[a]}`' for a in in_order)}.",
                  ""]
    ratio_table = report.get("ratios") or []
    if ratio_table:
        lines += ["## Ratios with 95% bootstrap intervals (paired by request; n.s. = the interval holds 1)", "",
                  "| rate | system | / baseline | stat | value | baseline | ratio | 95% CI | significant |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in ratio_table:
            ci = "n/a" if row.get("low") is None else f"[{row['low']:.2f}, {row['high']:.2f}]"
            sig = {True: "yes", False: "**no (n.s.)**", None: "n/a"}[row.get("significant")]
            ratio = "n/a" if row.get("ratio") is None else f"{row['ratio']:.2f}x"
            lines.append(f"| {_fmt_rate(_rate_from_json(row['rate']))} | {row['system']} | {row['baseline']} "
                         f"| {row['stat']} | {_fmt_value(row['stat'], row.get('value'))} "
                         f"| {_fmt_value(row['stat'], row.get('baseline_value'))} | {ratio} | {ci} | {sig} |")
        lines.append("")
    answers = report.get("answers") or []
    if answers:
        lines += ["## Answers", "",
                  "| rate | system | vs | same tokens | answers naming what was asked |", "|---|---|---|---|---|"]
        for row in answers:
            named = "n/a" if row.get("checked") is None else f"{row['hit']}/{row['checked']}"
            lines.append(f"| {_fmt_rate(_rate_from_json(row['rate']))} | {row['system']} | {row['baseline']} "
                         f"| {row['equal']}/{row['n']} | {named} |")
        lines.append("")
    rows = report.get("breakdown") or []
    if rows:
        lines += ["## Breakdown (like the PCR paper's Table 1): mean TTFT with and without each mechanism", "",
                  "| rate | mechanism | without | TTFT without | TTFT pcr | reduction | 95% CI |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows:
            red = row.get("reduction")
            lo, hi = row.get("reduction_low"), row.get("reduction_high")
            ci = "n/a" if lo is None else f"[{lo:+.1%}, {hi:+.1%}]{'' if row.get('significant') else ' n.s.'}"
            lines.append(f"| {_fmt_rate(_rate_from_json(row['rate']))} | {row['mechanism']} | {row['without']} "
                         f"| {format_seconds(row['value_without'])} | {format_seconds(row['value_pcr'])} "
                         f"| {'n/a' if red is None else f'{red:+.1%}'} | {ci} |")
        lines.append("")
    targets = report.get("targets") or []
    if targets:
        lines += ["## Targets", ""]
        for t in targets:
            res = TargetResult(**{**t, "rate": _rate_from_json(t["rate"]),
                                  "max_ratio": _rate_from_json(t["max_ratio"])})
            lines.append(f"- {res.line()}")
        lines.append("")
    bounds = report.get("schedule_bound") or []
    if bounds:
        lines += ["## Admission bound (what any admission order could gain; `pcr_rag.bench.schedule_bound`)", "",
                  "| rate | requests | waiting under FCFS | FCFS model | best order (SRPT) | ratio | measured FCFS "
                  "| cache-aware s/token over FCFS's |",
                  "|---|---|---|---|---|---|---|---|"]
        for b in bounds:
            speed = b.get("speed_ratio")
            speed = "n/a" if speed is None or math.isnan(speed) else f"{speed:.2f}x"
            lines.append(f"| {_fmt_rate(_rate_from_json(b['rate']))} | {b['requests']} | {b['overlapping']} "
                         f"| {format_seconds(b['fcfs_mean_s'])} | {format_seconds(b['best_mean_s'])} "
                         f"| {b['ratio']:.3f}x | {format_seconds(b['measured_fcfs_mean_s'])} | {speed} |")
        lines.append("")
    if report.get("limit_ratio") is not None:
        lines += ["## Limit ratio", "", "```json", json.dumps(report["limit_ratio"], indent=2), "```", ""]
    if report.get("bounds"):  # a replayed trace (pcr-rag bench --trace)
        lines += bounds_markdown(report["bounds"])
    notes = report.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def _num(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):.3g}"


def write_markdown(report: Mapping[str, Any], path: str | Path, *, title: str | None = None) -> Path:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(markdown_report(report, title=title), encoding="utf-8")
    return p


# ------------------------------------------------------------------------------------------------ plots


def write_plots(report: Mapping[str, Any], out_dir: str | Path, *, prefix: str = "") -> list[Path]:
    """PNG plots (matplotlib figures without pyplot: no global state, no GUI backend) into ``out_dir``; returns
    the files written.

    ``ttft_vs_rate.png`` (mean and P99 TTFT per system over the rate sweep, like the paper's Fig. 14),
    ``latency_percentiles.png`` (TTFT / E2EL P50-P95-P99 per system at the middle rate),
    ``hit_ratio.png`` (reused prompt tokens by tier), ``breakdown.png`` (pcr and its ablations) and,
    when windows were swept, ``prefetch_window.png``."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if not report["runs"]:
        return written
    systems = list(dict.fromkeys(r["system"] for r in report["runs"] if not _is_window_variant(r)))
    finite = [r for r in rates(report) if not math.isinf(r)]
    at = mid_rate(report)

    def figure(ncols: int, size: tuple[float, float]) -> tuple[Figure, Any]:
        fig = Figure(figsize=size)
        return fig, fig.subplots(1, ncols)

    def save(fig: Figure, name: str) -> None:
        path = out / f"{prefix}{name}"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        written.append(path)

    # 1. TTFT vs rate.
    fig, axes = figure(2, (11, 4))
    for ax, stat in zip(axes, ("mean", "p99"), strict=True):
        for s in systems:
            xs, ys = [], []
            for rate in finite or rates(report):
                v = _stat(run_for(report, s, rate), f"ttft.{stat}")
                if v is not None:
                    xs.append(rate if not math.isinf(rate) else 0.0)
                    ys.append(v)
            if xs:
                ax.plot(xs, ys, marker="o", label=s)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"TTFT {stat} (s)")
        ax.set_title(f"TTFT {stat} vs request rate")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save(fig, "ttft_vs_rate.png")

    # 2. Latency percentiles at the middle rate.
    at_runs = [r for r in report["runs"] if _rate_from_json(r["rate"]) == at and not _is_window_variant(r)]
    fig, axes = figure(2, (11, 4))
    width = 0.8 / 3
    for ax, metric in zip(axes, ("ttft", "e2el"), strict=True):
        for i, stat in enumerate(("p50", "p95", "p99")):
            vals = [r[metric][stat] or 0.0 for r in at_runs]
            ax.bar([j + i * width for j in range(len(at_runs))], vals, width, label=stat.upper())
        ax.set_xticks([j + width for j in range(len(at_runs))])
        ax.set_xticklabels([r["system"] for r in at_runs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{metric.upper()} (s)")
        ax.set_title(f"{metric.upper()} percentiles at {_fmt_rate(at)}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    save(fig, "latency_percentiles.png")

    # 3. Hit ratio by tier at the middle rate.
    fig, ax = figure(1, (7, 4))
    bottom = [0.0] * len(at_runs)
    for tier in TIERS:
        vals = [r["hit_ratio"][tier] for r in at_runs]
        ax.bar(range(len(at_runs)), vals, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(at_runs)))
    ax.set_xticklabels([r["system"] for r in at_runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of prompt tokens reused")
    ax.set_ylim(0, 1)
    ax.set_title(f"KV reuse by tier at {_fmt_rate(at)}")
    ax.legend(fontsize=8)
    save(fig, "hit_ratio.png")

    # 4. Breakdown: pcr and its ablations, mean TTFT per rate.
    names = [n for n in ("ssd-on-demand", "pcr-no-overlap", "pcr-no-prefetch", "pcr-lru", "pcr") if n in systems]
    if "pcr" in names and len(names) > 1:
        rs = finite or rates(report)
        fig, ax = figure(1, (8, 4))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [_stat(run_for(report, n, rate), "ttft.mean") or 0.0 for rate in rs]
            ax.bar([j + i * width for j in range(len(rs))], vals, width, label=n)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rs))])
        ax.set_xticklabels([_fmt_rate(r) for r in rs])
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title("Contribution of overlap, prefetch and look-ahead eviction")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        save(fig, "breakdown.png")

    # 5. Prefetch window sweep.
    sweep: dict[float, list[tuple[int, float]]] = {}
    for r in report["runs"]:
        w = (r.get("extra") or {}).get("prefetch_window")
        if w is None or not (r["system"] == "pcr" or _is_window_variant(r)):
            continue
        v = _stat(r, "ttft.mean")
        if v is not None:
            sweep.setdefault(_rate_from_json(r["rate"]), []).append((int(w), v))
    sweep = {k: sorted(set(v)) for k, v in sweep.items() if len({w for w, _ in v}) > 1}
    if sweep:
        fig, ax = figure(1, (6, 4))
        for rate, pts in sorted(sweep.items()):
            ax.plot([w for w, _ in pts], [v for _, v in pts], marker="o", label=_fmt_rate(rate))
        ax.set_xlabel("prefetch window (requests)")
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title("Prefetch look-ahead window sweep")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "prefetch_window.png")
    return written


def _is_window_variant(run: Mapping[str, Any]) -> bool:
    return str(run["system"]).startswith("pcr-window-")


def write_report(report: Mapping[str, Any], *, json_path: str | Path | None = None,
                 markdown_path: str | Path | None = None, plot_dir: str | Path | None = None,
                 title: str | None = None) -> dict[str, Any]:
    """Write whichever outputs have a path; returns ``{"json": Path|None, "markdown": Path|None, "plots": [...]}``."""
    return {
        "json": write_json(report, json_path) if json_path else None,
        "markdown": write_markdown(report, markdown_path, title=title) if markdown_path else None,
        "plots": write_plots(report, plot_dir) if plot_dir else [],
    }
