"""benchmarks/itl_budget.py: runs every budget per trial and restores the engine's own budget (tiny model)."""

from __future__ import annotations

import pytest

from benchmarks.itl_budget import BudgetTrial, measure_itl_budget, summarize
from pcr_rag import ConfigError, EngineConfig, PCREngine
from pcr_rag.testing import tiny_model

PASSAGES = [f"Passage {i} says that the river number {i} flows north through the valley of stones. " * 6
            for i in range(9)]


def test_every_budget_runs_once_per_trial_and_the_engine_is_restored(tmp_path):
    model, tok = tiny_model("llama")
    config = EngineConfig(cache_dir=tmp_path, enable_cache=False, device="cpu", prefill_chunk_tokens=32,
                          max_new_tokens=8)
    with PCREngine(model=model, tokenizer=tok, config=config) as eng:
        eos = eng.executor.eos_ids
        trials = measure_itl_budget(eng, PASSAGES, budgets=(None, 3.0), trials=2, documents=2, stream_tokens=16,
                                    start_after=2)
        assert eng.executor.budget.budget_steps == 3.0 and eng.executor.eos_ids == eos
    assert [(t.trial, t.budget_steps) for t in trials] == [(0, None), (0, 3.0), (1, 3.0), (1, None)]
    assert all(t.max_gap_s >= t.median_gap_s > 0 and t.cold_ttft_s > 0 and t.cold_prompt_tokens > 40
               for t in trials)


def test_summary_reads_ratios_within_a_trial():
    trials = [BudgetTrial(None, 0, 1.0, 0.1, 2.0, 900), BudgetTrial(3.0, 0, 0.3, 0.1, 3.0, 900)]
    assert summarize(trials) == ["budget None: longest gap / median gap 10.0",
                                 "budget 3.0: longest gap / median gap 3.0; cold TTFT vs whole steps 1.50"]


def test_bad_arguments_raise_before_any_request_runs(tmp_path):
    """Too few passages (the stream's must not be a cold prompt's), a stream too short to start the cold prompt,
    or an invalid budget: each raises before the engine runs a step."""
    model, tok = tiny_model("llama")
    config = EngineConfig(cache_dir=tmp_path, enable_cache=False, device="cpu", max_new_tokens=8)
    with PCREngine(model=model, tokenizer=tok, config=config) as eng:
        with pytest.raises(ValueError, match="too few"):
            measure_itl_budget(eng, PASSAGES[:8], budgets=(None, 3.0), trials=2, documents=2)
        with pytest.raises(ValueError, match="start_after"):
            measure_itl_budget(eng, PASSAGES, budgets=(None,), trials=1, stream_tokens=4, start_after=4)
        with pytest.raises(ConfigError, match="itl_budget_steps"):
            measure_itl_budget(eng, PASSAGES, budgets=(None, 1.0), trials=1)
        assert eng.executor.steps == 0
