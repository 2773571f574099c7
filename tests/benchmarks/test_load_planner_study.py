"""``benchmarks/load_planner.py`` on a tiny random model: every phase runs its three systems interleaved, the
answers match cache off, and on a throttled SSD the planner recomputes what always-load reads."""

from __future__ import annotations

import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import LocalDirBackend, SlowBackend
from pcr_rag.testing import tiny_model


def test_load_planner_study_runs_every_phase_on_a_tiny_model(tmp_path):
    from benchmarks.load_planner import measure, summarize, time_planner

    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    passages = [f"Passage {i} tells how the river {i} meets the sea beyond the hills of stone. " * 4
                for i in range(16)]
    storage = SlowBackend(LocalDirBackend(tmp_path / "c"))
    common = dict(chunk_size=16, device="cpu", dtype="float32", max_new_tokens=4, warmup=False)
    with PCREngine(model=model, tokenizer=tok, config=EngineConfig(enable_cache=False, **common)) as off, \
            PCREngine(model=model, tokenizer=tok, storage=storage,
                      config=EngineConfig(cache_dir=tmp_path / "c", dram_capacity="64MiB", **common)) as on:
        rows, keys = measure(off, on, storage, passages, phases=[("ssd-slow", 2e5), ("dram", None), ("miss", None)],
                             requests=2, documents=2)
        timing = time_planner(on, keys, calls=10)
        recomputed = on.stats().cache.recomputed_instead_of_loaded["ssd"]
    assert [(r.phase, r.system) for r in rows].count(("miss", "always-load")) == 0
    assert len(rows) == 2 * 3 + 2 * 3 + 2 * 2
    by = {(r.phase, r.system, r.index): r for r in rows}
    assert all(r.token_ids == by[(r.phase, "off", r.index)].token_ids for r in rows)
    slow = [by[("ssd-slow", s, k)] for s in ("always-load", "measured") for k in range(2)]
    assert all(r.reused_tokens > 0 for r in slow[:2])  # always-load reads the 200 kB/s disk
    assert recomputed > 0  # the planner does not (a tiny model computes a chunk faster than that)
    assert timing["plan_us"] > 0 and timing["matched"] > 0
    assert [line.split(":")[0] for line in summarize(rows)] == ["ssd-slow", "dram", "miss"]
