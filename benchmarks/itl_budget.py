"""The ITL budget's trade-off: a streaming answer's longest gap vs a cold prompt's TTFT, budget on and off.

Each trial on one engine (cache off, so every prompt is cold): one request streams ``stream_tokens`` tokens (EOS
off); after its ``start_after``-th token a cold prompt of ``documents`` passages arrives. Recorded: the stream's
longest gap between two tokens over its median gap (what the budget bounds) and the cold prompt's TTFT. Every
trial runs each budget once (``budgets``; None = whole prefill steps), in rotated order, each with its own
passages (timings on a shared machine are noisy; ratios within one trial hold).

Run: ``python benchmarks/itl_budget.py`` (default model, budgets None, 3 and 4) or call `measure_itl_budget`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.rag.corpus import split_passages, stdlib_corpus
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.sched.step_budget import check_budget_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetTrial:
    """One trial of one budget: the stream's gaps (seconds) and the cold prompt's TTFT (seconds) and length."""

    budget_steps: float | None
    trial: int
    max_gap_s: float
    median_gap_s: float
    cold_ttft_s: float
    cold_prompt_tokens: int

    @property
    def gap_ratio(self) -> float:
        return self.max_gap_s / self.median_gap_s


def measure_itl_budget(engine: PCREngine, passages: Sequence[str], *, budgets: Sequence[float | None] = (None, 3.0, 4.0),
                       trials: int = 3, documents: int = 3, stream_tokens: int = 120,
                       start_after: int = 5) -> list[BudgetTrial]:
    """Trials as in the module docstring, on ``engine`` (its budget is set per run and restored after). Bad
    arguments raise before any request runs: each budget must be a valid ``itl_budget_steps``, the stream must
    outlast ``start_after`` tokens, and every run needs its own ``documents`` passages plus the stream's (the
    last passage, never one of the cold prompts')."""
    for budget in budgets:
        check_budget_steps(budget)
    if not 0 <= start_after < stream_tokens:
        raise ValueError(f"start_after must be in [0, stream_tokens={stream_tokens}), got {start_after}")
    needed = trials * len(budgets) * documents + 1
    if len(passages) < needed:
        raise ValueError(f"{len(passages)} passages are too few: {trials} trials x {len(budgets)} budgets x "
                         f"{documents} documents + 1 for the stream = {needed}")
    executor = engine.executor
    saved_budget, saved_eos = executor.budget.budget_steps, executor.eos_ids
    executor.eos_ids = frozenset()  # the stream must outlast the cold prompt
    out: list[BudgetTrial] = []
    used = 0
    try:
        for trial in range(trials):
            order = list(budgets[trial % len(budgets):]) + list(budgets[: trial % len(budgets)])
            for budget in order:
                executor.budget.budget_steps = budget
                docs = tuple(passages[used: used + documents])
                used += documents
                stream = engine.submit(RagPrompt("Summarise this.", (passages[-1],)),
                                       SamplingParams(max_new_tokens=stream_tokens))
                stamps: list[float] = []
                cold = None
                for chunk in stream:
                    stamps.append(time.perf_counter())
                    if chunk.index == start_after:
                        cold = engine.submit(RagPrompt("What is this about?", docs), SamplingParams(max_new_tokens=1))
                result = cold.result()
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                out.append(BudgetTrial(budget, trial, max(gaps), statistics.median(gaps), result.metrics.ttft_s,
                                       result.metrics.prompt_tokens))
                log.info("trial %d budget %s: longest gap %.0f ms (%.1fx the median), cold TTFT %.2f s", trial,
                         budget, out[-1].max_gap_s * 1e3, out[-1].gap_ratio, out[-1].cold_ttft_s)
    finally:
        executor.budget.budget_steps, executor.eos_ids = saved_budget, saved_eos
    return out


def summarize(trials: Sequence[BudgetTrial]) -> list[str]:
    """One line per budget: gap ratios, and the cold TTFT over the same trial's whole-step TTFT (when run)."""
    whole = {t.trial: t.cold_ttft_s for t in trials if t.budget_steps is None}
    lines = []
    for budget in dict.fromkeys(t.budget_steps for t in trials):
        mine = [t for t in trials if t.budget_steps == budget]
        ratios = ", ".join(f"{t.gap_ratio:.1f}" for t in mine)
        line = f"budget {budget}: longest gap / median gap {ratios}"
        if budget is not None and whole:
            line += "; cold TTFT vs whole steps " + ", ".join(
                f"{t.cold_ttft_s / whole[t.trial]:.2f}" for t in mine if t.trial in whole)
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/itl_budget.py", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--documents", type=int, default=3, help="passages in the cold prompt")
    parser.add_argument("--budgets", default="none,3,4", help="comma-separated; none = whole prefill steps")
    parser.add_argument("--json", help="write the trials here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    budgets = [None if b.strip().lower() == "none" else float(b) for b in args.budgets.split(",")]
    passages = [p.text for p in split_passages(stdlib_corpus())]
    with PCREngine(config=EngineConfig(enable_cache=False)) as engine:
        trials = measure_itl_budget(engine, passages, budgets=budgets, trials=args.trials, documents=args.documents)
    for line in summarize(trials):
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([asdict(t) | {"gap_ratio": t.gap_ratio} for t in trials], fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
