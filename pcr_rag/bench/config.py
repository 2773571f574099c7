"""What a ``pcr-rag bench`` run depends on: `BenchConfig`, its presets, and the prompt every request uses."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pcr_rag.bench.systems import BENCH_DEFAULT_SYSTEMS, ORDERS, parse_systems

__all__ = [
    "DEFAULT_NUM_QUESTIONS",
    "QUICK_CAVEAT",
    "RETRIEVAL_PASSAGES",
    "STANDARD_RETRIEVAL_SYSTEMS",
    "STANDARD_SYSTEMS",
    "SYSTEM_PROMPT",
    "BenchConfig",
    "BenchError",
    "quick_config",
    "standard_config",
]

#: The system prompt of every benchmark request (segment 0 of the prompt: shared by all requests).
SYSTEM_PROMPT = "You are a concise assistant. Answer the question using only the documents provided."
#: Passage pool of a ``--retrieval`` run unless ``--passages`` says otherwise: enough titles for the built-in
#: question set (the stdlib corpus at 120-token passages holds ~530 titles in 400 passages).
RETRIEVAL_PASSAGES = 400
#: Questions generated from the corpus's titles for ``--retrieval`` at most (the built-in question set).
DEFAULT_NUM_QUESTIONS = 200
#: What ``--quick`` reports say first.
QUICK_CAVEAT = ("--quick is a smoke run: its ratios are indicative only (few requests per system; see the "
                "intervals). Use --standard to tell systems apart.")
#: ``--standard``: the systems its serving targets need (schedule variants skip themselves on an engine without
#: a ``schedule`` option).
STANDARD_SYSTEMS: tuple[str, ...] = ("no-reuse", "transformers", "pcr", "pcr-schedule-fcfs", "pcr-schedule-cache-aware")
#: ``--standard --retrieval``: the systems its retrieval targets need (pcr in both document orders).
STANDARD_RETRIEVAL_SYSTEMS: tuple[str, ...] = ("no-reuse", "dram-only", "ssd-on-demand", "pcr", "pcr@relevance")


class BenchError(RuntimeError):
    """The benchmark cannot run as configured (the message says what to change)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on. Sizes in tokens, times in seconds, rates in requests/s.

    ``loads``: request rates as multiples of the measured no-reuse capacity (used when ``rates`` is None).
    ``num_topics``: distinct retrieval lists (topic mode, see `pcr_rag.bench.workload`); None = every request
    draws its own documents. ``retrieval``: instead, topics are real questions (``questions`` file, default
    ``num_questions`` questions generated from the corpus's own titles) with their top-k passages from Chroma +
    MiniLM. ``order``: the document order of the cached systems, ``relevance`` or ``cache-aware`` (a system
    named ``X@order`` overrides it). ``windows``: prefetch windows swept at ``sweep_rates`` ("mid" or "all").
    ``saturation``: ``max_active`` values compared at saturation (all ``saturation_requests`` requests at once,
    default ``num_requests``; ``()`` = skip, the default outside the presets). ``repeats``: measured traces per rate, systems interleaved in a
    rotated order within each. ``threads``: torch (and llama.cpp) compute threads (None: CPUs - 1, leaving a
    core for I/O, prefetch and write-back). ``limit_tokens``: document prefix of the limit-ratio measurement.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    corpus: str | None = None
    max_docs: int | None = None
    tokens_per_passage: int = 300
    num_passages: int | None = 256
    top_k: int = 3
    num_topics: int | None = 64
    retrieval: bool = False
    questions: str | None = None
    num_questions: int = DEFAULT_NUM_QUESTIONS
    order: str = "relevance"
    zipf_exponent: float = 1.0
    num_requests: int = 32
    warmup_requests: int = 16
    loads: tuple[float, ...] = (0.4, 0.7, 1.0)
    rates: tuple[float, ...] | None = None
    burstiness: float = 1.0
    repeats: int = 1
    systems: tuple[str, ...] = BENCH_DEFAULT_SYSTEMS
    windows: tuple[int, ...] = (2, 4, 8, 10)
    sweep_rates: str = "mid"
    saturation: tuple[int, ...] = ()
    saturation_requests: int | None = None
    max_new_tokens: int = 32
    chunk_size: int = 256
    dram_fraction: float = 0.25
    ssd_fraction: float = 1.0
    seed: int = 0
    work_dir: str | None = None
    threads: int | None = None
    limit_ratio: bool = True
    limit_tokens: int = 1024
    limit_reps: int = 5
    quick: bool = False
    standard: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise `BenchError` (or `UnknownSystemError`) naming what to change; no compute happens before."""
        if self.num_requests < 1 or self.warmup_requests < 0 or self.repeats < 1:
            raise BenchError("num_requests and repeats must be >= 1, warmup_requests >= 0")
        if self.rates is None and not self.loads:
            raise BenchError("give request rates (--rates) or load factors (--loads)")
        if any(not r > 0 for r in (self.rates or self.loads)):
            raise BenchError("rates and loads must be > 0 (use 'inf' for all-at-once)")
        if self.sweep_rates not in ("mid", "all"):
            raise BenchError(f"sweep_rates must be 'mid' or 'all', got {self.sweep_rates!r}")
        if self.max_new_tokens < 1:
            raise BenchError("max_new_tokens must be >= 1")
        if self.order not in ORDERS:
            raise BenchError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if any(n < 1 for n in self.saturation) or (self.saturation_requests is not None
                                                    and self.saturation_requests < 1):
            raise BenchError("saturation max_active values and saturation_requests must be >= 1")
        if self.num_questions < 1:
            raise BenchError("num_questions must be >= 1")
        if self.quick and self.standard:
            raise BenchError("choose one preset: --quick or --standard")
        parse_systems(list(self.systems))  # raises UnknownSystemError naming the known systems

    @property
    def rate_slots(self) -> tuple[float, ...]:
        """One measured trace per slot: the absolute ``rates`` when given, else the ``loads``."""
        return self.rates if self.rates is not None else self.loads

    @property
    def saturation_size(self) -> int:
        """Requests of one saturation trace."""
        return self.saturation_requests or self.num_requests


def quick_config(**overrides: Any) -> BenchConfig:
    """The ``--quick`` preset (a smoke run, ratios indicative only): every system, two rates, 12 requests per
    system and rate, the saturation pair, window 2; the shortest preset (wall time: docs/benchmarks.md; the rates
    follow the no-reuse service time measured at the start: a busy start makes a slow run)."""
    base = BenchConfig(
        tokens_per_passage=120, num_passages=96, top_k=3, num_topics=16, num_requests=12, warmup_requests=8,
        loads=(0.7, 1.0), windows=(2,), saturation=(1, 8), max_new_tokens=8, limit_tokens=512, limit_reps=3,
        quick=True,
    )
    return replace(base, **overrides)


def standard_config(*, retrieval: bool = False, **overrides: Any) -> BenchConfig:
    """The ``--standard`` preset: resolves a 10% difference in mean TTFT between pcr and its cached or uncached
    engine baselines (95% interval, ~80% power) in one sitting on a quiet machine. Few systems
    (`STANDARD_SYSTEMS`, or `STANDARD_RETRIEVAL_SYSTEMS` in cache-aware order for ``--retrieval``), one rate
    (load 0.7), 4 interleaved repeats of 20 requests = 80 paired requests per system, saturation 4 x 16 requests,
    no window sweep, no ablations, no limit ratio.

    Sizing (docs/DESIGN.md, "Telling systems apart"): the paired requests a 10% difference needs are
    ``((1.96 + 0.84) sd(a - R b) / (0.1 mean(b)))^2`` (`pcr_rag.bench.stats.requests_to_resolve`); the pilot (a
    ``--quick`` run) asked for fewer than the preset's 80 against every engine baseline. pcr vs transformers pairs a
    hit-dependent TTFT with a flat one (a larger sd), so 80 requests resolve a coarser difference there, still
    finer than its target. Time: every timed run lasts ~n / rate x the quiet-machine no-reuse service time, times
    systems x repeats, plus warm-up, saturation and the traces (the pilot's figures and the wall time:
    docs/measurements-history.md#figures-moved-from-code-comments).
    """
    base = BenchConfig(
        tokens_per_passage=120, num_passages=RETRIEVAL_PASSAGES if retrieval else 96, top_k=3, num_topics=16,
        num_requests=20, repeats=4, warmup_requests=8, loads=(0.7,), windows=(), max_new_tokens=8,
        limit_ratio=False, standard=True,
        systems=STANDARD_RETRIEVAL_SYSTEMS if retrieval else STANDARD_SYSTEMS,
        saturation=() if retrieval else (1, 8), saturation_requests=16,
        retrieval=retrieval, order="cache-aware" if retrieval else "relevance",
    )
    return replace(base, **overrides)
