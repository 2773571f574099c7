"""benchmarks/hit_behind_cold.py: every (fraction, schedule) runs once per trial in rotated order, and the engine's
schedule is restored (tiny model)."""

from __future__ import annotations

import pytest

from benchmarks.hit_behind_cold import HitTrial, measure_hit_behind_cold, summarize
from pcr_rag import ConfigError, EngineConfig, PCREngine
from pcr_rag.testing import tiny_model

PASSAGES = [f"Passage {i} says that the river number {i} flows north through the valley of stones. " * 4
            for i in range(22)]


def _engine(tmp_path, **kw) -> PCREngine:
    model, tok = tiny_model("llama")
    config = EngineConfig(cache_dir=tmp_path, device="cpu", prefill_chunk_tokens=32, max_new_tokens=4, **kw)
    return PCREngine(model=model, tokenizer=tok, config=config)


def test_every_fraction_and_schedule_runs_once_per_trial_and_the_schedule_is_restored(tmp_path):
    with _engine(tmp_path, schedule="fcfs") as eng:
        trials = measure_hit_behind_cold(eng, PASSAGES, fractions=(0.0, 0.5), trials=2, documents=2,
                                         hit_documents=1, max_new_tokens=2)
        assert eng.scheduler.schedule == eng.executor.schedule == "fcfs"
    assert [(t.trial, t.fraction, t.schedule) for t in trials] == [
        (0, 0.0, "fcfs"), (0, 0.0, "cache-aware"), (0, 0.5, "fcfs"), (0, 0.5, "cache-aware"),
        (1, 0.0, "cache-aware"), (1, 0.0, "fcfs"), (1, 0.5, "cache-aware"), (1, 0.5, "fcfs")]
    assert all(t.hit_ttft_s > 0 and t.cold_ttft_s > 0 and t.hit_alone_s > 0 and t.cold_prompt_tokens > 40
               for t in trials)
    assert all(t.hit_reused_tokens > 0 for t in trials), "every hit reused its cached passage"


def test_summary_is_per_fraction_and_schedule():
    trials = [HitTrial("cache-aware", 0.6, 0, 0.1, 2.5, 0.05, 400, 1200), HitTrial("fcfs", 0.6, 0, 1.0, 2.3, 0.05, 400, 1200)]
    assert summarize(trials) == [
        "hit at 60% of the cold prompt, cache-aware: hit TTFT 100 ms (2.0x alone), cold TTFT 2500 ms (1 runs)",
        "hit at 60% of the cold prompt, fcfs: hit TTFT 1000 ms (20.0x alone), cold TTFT 2300 ms (1 runs)"]


def test_bad_arguments_raise_before_any_request_runs(tmp_path):
    with _engine(tmp_path) as eng:
        with pytest.raises(ValueError, match="too few"):
            measure_hit_behind_cold(eng, PASSAGES, trials=2, documents=2)
        with pytest.raises(ValueError, match="fractions"):
            measure_hit_behind_cold(eng, PASSAGES, fractions=(1.0,))
        with pytest.raises(ConfigError, match="schedules"):
            measure_hit_behind_cold(eng, PASSAGES, schedules=("lifo",))
        assert eng.executor.steps == 0
    with _engine(tmp_path / "off", enable_cache=False) as eng, pytest.raises(ConfigError, match="cache on"):
        measure_hit_behind_cold(eng, PASSAGES)
