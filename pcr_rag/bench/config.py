"""What a ``pcr-rag bench`` run depends on: `BenchConfig`, its presets, and the prompt every request uses."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pcr_rag.bench.systems import DEFAULT_SYSTEMS, parse_systems

__all__ = ["SYSTEM_PROMPT", "BenchConfig", "BenchError", "quick_config"]

#: The system prompt of every benchmark request (segment 0 of the prompt: shared by all requests).
SYSTEM_PROMPT = "You are a concise assistant. Answer the question using only the documents provided."


class BenchError(RuntimeError):
    """The benchmark cannot run as configured (the message says what to change)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on. Sizes in tokens, times in seconds, rates in requests/s.

    ``loads``: request rates as multiples of the measured no-reuse capacity (used when ``rates`` is None).
    ``num_topics``: distinct retrieval lists (topic mode, see `pcr_rag.bench.workload`); None = every request
    draws its own documents. ``retrieval``: instead, topics are real questions (``questions`` file, default the
    built-in stdlib questions) with their top-k passages from Chroma + MiniLM. ``windows``: prefetch windows
    swept at ``sweep_rates`` ("mid" or "all"). ``threads``: torch compute threads (None: CPUs - 1, leaving a core
    for I/O, prefetch and write-back). ``limit_tokens``: document prefix of the limit-ratio measurement.
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
    zipf_exponent: float = 1.0
    num_requests: int = 32
    warmup_requests: int = 16
    loads: tuple[float, ...] = (0.4, 0.7, 1.0)
    rates: tuple[float, ...] | None = None
    burstiness: float = 1.0
    repeats: int = 1
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    windows: tuple[int, ...] = (2, 4, 8, 10)
    sweep_rates: str = "mid"
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
        parse_systems(list(self.systems))  # raises UnknownSystemError naming the known systems

    @property
    def rate_slots(self) -> tuple[float, ...]:
        """One measured trace per slot: the absolute ``rates`` when given, else the ``loads``."""
        return self.rates if self.rates is not None else self.loads


def quick_config(**overrides: Any) -> BenchConfig:
    """The ``--quick`` preset: every system, two rates, a small trace; < 10 minutes on 2 CPU cores."""
    base = BenchConfig(
        tokens_per_passage=120, num_passages=96, top_k=3, num_topics=16, num_requests=12, warmup_requests=8,
        loads=(0.7, 1.0), windows=(2,), max_new_tokens=8, limit_tokens=512, limit_reps=3, quick=True,
    )
    return replace(base, **overrides)
