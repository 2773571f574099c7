"""A cache hit arriving during a cold prompt's prefill: the hit's TTFT and the cold prompt's, by when the hit
arrives and by admission schedule.

One engine, cache on. First the hit's ``hit_documents`` passages are cached and a cold prompt is timed alone
(``cold_s``, after an untimed one). Then each trial runs, for every arrival ``fraction`` and every schedule (rotated order per trial), a
cold prompt of ``documents`` fresh passages and, ``fraction * cold_s`` seconds after it, a hit: a new question on
the cached passages. Both TTFTs are recorded; each trial also times the hit alone. Under ``fcfs`` the hit waits for
the whole cold prompt; under ``cache-aware`` it should not, wherever it arrives (`pcr_rag.sched.admission`: a
prefill's own steps count as waiting only against requests that were already there). The schedule is switched on
the running engine (its scheduler's and executor's), and restored after.

Run: ``python benchmarks/hit_behind_cold.py`` (default model, one torch thread as in the serving bench) or call
`measure_hit_behind_cold`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.errors import ConfigError
from pcr_rag.rag.corpus import split_passages, stdlib_corpus
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.sched.admission import SCHEDULES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HitTrial:
    """One run: the schedule, when the hit arrived (a fraction of the cold prompt's time alone), both TTFTs, the
    hit's TTFT alone in the same trial (seconds), the prompt tokens the hit reused and the cold prompt's length."""

    schedule: str
    fraction: float
    trial: int
    hit_ttft_s: float
    cold_ttft_s: float
    hit_alone_s: float
    hit_reused_tokens: int
    cold_prompt_tokens: int


def measure_hit_behind_cold(engine: PCREngine, passages: Sequence[str], *, fractions: Sequence[float] = (0.1, 0.6, 0.8),
                            schedules: Sequence[str] = SCHEDULES, trials: int = 3, documents: int = 4,
                            hit_documents: int = 2, max_new_tokens: int = 8) -> list[HitTrial]:
    """Trials as in the module docstring, on ``engine`` (cache on, at least two rows). Bad arguments raise before
    any request runs: fractions in [0, 1), known schedules, and enough passages for the hit, the two timing runs and
    every run's own cold prompt."""
    if not engine.config.enable_cache or engine.config.max_active < 2:
        raise ConfigError("the hit-behind-cold bench needs the cache on and max_active >= 2")
    if not fractions or any(not 0 <= f < 1 for f in fractions):
        raise ValueError(f"fractions must be in [0, 1), got {list(fractions)}")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ConfigError(f"schedules must be some of {list(SCHEDULES)}, got {list(schedules)}")
    needed = hit_documents + documents * (2 + trials * len(fractions) * len(schedules))
    if len(passages) < needed:
        raise ValueError(f"{len(passages)} passages are too few: {hit_documents} for the hit + {documents} x "
                         f"(2 timing runs + {trials} trials x {len(fractions)} fractions x {len(schedules)} "
                         f"schedules) = {needed}")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    hit_docs = tuple(passages[:hit_documents])
    fresh = iter(range(hit_documents, len(passages), documents))

    def cold_prompt(k: int) -> RagPrompt:
        start = next(fresh)
        return RagPrompt(f"What does passage set {k} say?", tuple(passages[start:start + documents]))

    engine.generate("Which passages are these?", hit_docs, max_new_tokens=2)  # caches the hit's documents
    engine.submit(cold_prompt(-1), SamplingParams(max_new_tokens=1)).result()  # first-call costs, untimed
    started = time.perf_counter()
    engine.submit(cold_prompt(0), SamplingParams(max_new_tokens=1)).result()
    cold_s = time.perf_counter() - started
    log.info("a cold prompt of %d passages alone: %.0f ms", documents, cold_s * 1e3)
    saved = engine.scheduler.schedule, engine.executor.schedule
    out: list[HitTrial] = []
    k = 0
    try:
        for trial in range(trials):
            alone = engine.submit(RagPrompt(f"Hit question {trial} alone?", hit_docs), params).result()
            order = list(schedules[trial % len(schedules):]) + list(schedules[:trial % len(schedules)])
            for fraction in fractions:
                for schedule in order:
                    engine.scheduler.schedule = engine.executor.schedule = schedule
                    k += 1
                    cold = engine.submit(cold_prompt(k), params)
                    time.sleep(fraction * cold_s)
                    hit = engine.submit(RagPrompt(f"Hit question number {k}?", hit_docs), params)
                    h, c = hit.result(), cold.result()
                    out.append(HitTrial(schedule, fraction, trial, h.metrics.ttft_s, c.metrics.ttft_s,
                                        alone.metrics.ttft_s, h.metrics.reused_tokens, c.metrics.prompt_tokens))
                    log.info("trial %d, hit at %.0f%%, %s: hit TTFT %.0f ms, cold TTFT %.0f ms", trial,
                             fraction * 100, schedule, h.metrics.ttft_s * 1e3, c.metrics.ttft_s * 1e3)
    finally:
        engine.scheduler.schedule, engine.executor.schedule = saved
    return out


def summarize(trials: Sequence[HitTrial]) -> list[str]:
    """One line per (fraction, schedule): mean hit and cold TTFTs, and the hit's mean TTFT over its time alone."""
    lines = []
    for fraction in dict.fromkeys(t.fraction for t in trials):
        for schedule in dict.fromkeys(t.schedule for t in trials):
            mine = [t for t in trials if t.fraction == fraction and t.schedule == schedule]
            hit = statistics.fmean(t.hit_ttft_s for t in mine)
            alone = statistics.fmean(t.hit_alone_s for t in mine)
            cold = statistics.fmean(t.cold_ttft_s for t in mine)
            lines.append(f"hit at {fraction:.0%} of the cold prompt, {schedule}: hit TTFT {hit * 1e3:.0f} ms "
                         f"({hit / alone:.1f}x alone), cold TTFT {cold * 1e3:.0f} ms ({len(mine)} runs)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/hit_behind_cold.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--fractions", default="0.1,0.6,0.8", help="comma-separated arrival points in [0, 1)")
    parser.add_argument("--documents", type=int, default=4, help="passages in the cold prompt")
    parser.add_argument("--passage-tokens", type=int, default=280,
                        help="passage length; only passages of at least 90%% of it are used, so cold prompts match")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the serving bench uses 1)")
    parser.add_argument("--json", help="write the trials here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    fractions = [float(f) for f in args.fractions.split(",")]
    with tempfile.TemporaryDirectory(prefix="pcr-hit-behind-cold-") as cache_dir, \
            PCREngine(config=EngineConfig(cache_dir=cache_dir, dram_capacity="1GiB")) as engine:
        tok = engine.tokenizer
        docs = split_passages(stdlib_corpus(), tokens_per_passage=args.passage_tokens, tokenizer=tok)
        passages = [p.text for p in docs if len(tok.encode(p.text)) >= 0.9 * args.passage_tokens]
        trials = measure_hit_behind_cold(engine, passages, fractions=fractions, trials=args.trials,
                                         documents=args.documents)
    for line in summarize(trials):
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([asdict(t) for t in trials], fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
