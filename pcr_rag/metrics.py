"""Per-request and per-engine latency metrics (seconds), hit counts (tokens), percentiles and Prometheus text."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

TIERS = ("device", "dram", "ssd", "remote")
#: How a prompt is served (`RequestMetrics.reuse`): exact prefix reuse only, or blend mode (`pcr_rag.sched.blend`).
REUSE_MODES = ("exact", "blend")


@dataclass
class RequestMetrics:
    """What one request cost. Times in seconds from submission; token counts in tokens.

    ttft_s: submission -> first generated token (includes queueing). e2e_s: submission -> last token.
    queue_s: submission -> start of prefill (a row). prefill_s: start of prefill -> first token's logits;
    prefill_compute_s: the part of prefill_s its own prefill steps ran (forward layers, offloads, KV load waits);
    the rest, prefill_s - prefill_compute_s, is other requests' decode and prefill steps run between its own.
    load_wait_s: the part of prefill_compute_s spent waiting for its cached KV (layer loads, in-flight prefetches).
    itl_s: gaps between consecutive generated tokens.
    computed_tokens + reused_tokens + blended_tokens == prompt_tokens (blended_tokens: blend mode's placed tokens
    whose position-independent KV was cached before the request, approximate KV - a document computed in isolation
    by this request and placed counts as computed; reused_tokens: the exact prefix, "cached_tokens" in the API);
    reused_by_tier splits reused_tokens by the tier the KV
    came from when the request ran. prefetch_hit_chunks: chunks on SSD when the request entered the queue (or
    was announced) and in memory when it ran. recomputed_after_error: times its prefill gave up cached KV because
    the cache or a store failed (a load raising, a checksum or MAC failing, a read timing out, the lease itself
    failing) and recomputed it instead.
    """

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    reused_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    generated_tokens: int = 0
    prefetch_hit_chunks: int = 0
    load_wait_s: float = 0.0
    recomputed_after_error: int = 0
    announced: bool = False
    prefill_compute_s: float = 0.0  # last, so the fields before it keep their positions
    blended_tokens: int = 0  # blend mode: prompt tokens placed from documents' cached position-independent KV
    reuse: str = "exact"     # how the prompt was served: "exact", or "blend" (`pcr_rag.sched.blend`)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of ``values``; NaN for an empty sequence."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p95 / p99 of ``values`` (seconds); NaN when empty."""
    return {
        "mean": (sum(values) / len(values)) if values else math.nan,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


class MetricsRecorder:
    """Thread-safe rolling window of finished requests' metrics (the last ``window`` requests)."""

    def __init__(self, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._recent: deque[RequestMetrics] = deque(maxlen=window)
        self.requests_finished = 0
        self.requests_failed = 0
        self.requests_cancelled = 0
        self.prompt_tokens = 0
        self.computed_tokens = 0
        self.reused_by_tier = dict.fromkeys(TIERS, 0)
        self.prefetch_hit_chunks = 0
        self.recomputed_after_error = 0  # prefills that gave up cached KV after a cache or store failure
        self.blended_tokens = 0
        self.blended_requests = 0

    def record(self, m: RequestMetrics) -> None:
        with self._lock:
            self._recent.append(m)
            self.requests_finished += 1
            self.prompt_tokens += m.prompt_tokens
            self.computed_tokens += m.computed_tokens
            for tier, n in m.reused_by_tier.items():
                self.reused_by_tier[tier] = self.reused_by_tier.get(tier, 0) + n
            self.prefetch_hit_chunks += m.prefetch_hit_chunks
            self.recomputed_after_error += m.recomputed_after_error
            self.blended_tokens += m.blended_tokens
            self.blended_requests += m.reuse == "blend"

    def record_failure(self, cancelled: bool = False) -> None:
        with self._lock:
            if cancelled:
                self.requests_cancelled += 1
            else:
                self.requests_failed += 1

    def snapshot(self) -> dict:
        with self._lock:
            recent = list(self._recent)
            out = {
                "requests_finished": self.requests_finished,
                "requests_failed": self.requests_failed,
                "requests_cancelled": self.requests_cancelled,
                "prompt_tokens": self.prompt_tokens,
                "computed_tokens": self.computed_tokens,
                "reused_tokens": sum(self.reused_by_tier.values()),
                "reused_by_tier": dict(self.reused_by_tier),
                "prefetch_hit_chunks": self.prefetch_hit_chunks,
                "recomputed_after_error": self.recomputed_after_error,
                "blended_tokens": self.blended_tokens,
                "blended_requests": self.blended_requests,
            }
        total = out["prompt_tokens"]
        out["hit_ratio"] = {t: (n / total if total else 0.0) for t, n in out["reused_by_tier"].items()}
        out["ttft"] = summarize([m.ttft_s for m in recent])
        out["e2el"] = summarize([m.e2e_s for m in recent])
        out["queue"] = summarize([m.queue_s for m in recent])
        out["prefill"] = summarize([m.prefill_s for m in recent])
        out["prefill_compute"] = summarize([m.prefill_compute_s for m in recent])
        out["itl"] = summarize([x for m in recent for x in m.itl_s])
        out["tpot"] = summarize([m.tpot_s for m in recent if m.itl_s])
        return out


def prometheus_text(stats: dict, prefix: str = "pcr_rag") -> str:
    """Flatten a nested stats dict of numbers into Prometheus exposition text (gauges)."""
    lines: list[str] = []

    def walk(obj: object, name: str, labels: Iterable[tuple[str, str]]) -> None:
        if isinstance(obj, bool):
            obj = int(obj)
        if isinstance(obj, (int, float)):
            if isinstance(obj, float) and math.isnan(obj):
                return
            lab = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{lab}}} {obj}" if lab else f"{name} {obj}")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                key = str(k)
                if key in TIERS or key.startswith("p") and key[1:].isdigit() or key == "mean":
                    label = "tier" if key in TIERS else "stat"
                    walk(v, name, (*labels, (label, key)))
                else:
                    walk(v, f"{name}_{_sanitize(key)}", labels)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, name, (*labels, ("index", str(i))))

    walk(stats, prefix, ())
    return "\n".join(lines) + "\n"


def _sanitize(key: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in key).strip("_").lower()
