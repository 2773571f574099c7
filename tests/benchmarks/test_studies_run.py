"""Every design study in ``benchmarks/`` still runs: as a script from any directory (its imports resolve against
the installed package, not the package folder it left), and its measurement on a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STUDIES = ("blend_quality", "grammar_cost", "hit_behind_cold", "itl_budget", "load_planner", "reorder_study", "server_overhead")


def test_every_study_is_listed_in_the_readme():
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    assert [s for s in STUDIES if not (BENCHMARKS / f"{s}.py").is_file() or f"`{s}.py`" not in readme] == []


@pytest.mark.parametrize("study", STUDIES)
def test_study_runs_as_a_script(study, tmp_path):
    # from an unrelated directory, with nothing on PYTHONPATH: `python benchmarks/<name>.py` as the README says
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{study}.py"), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")


def test_reorder_study_cost_places_the_cached_chain():
    from benchmarks.reorder_study import measure_cost

    _, tok = tiny_model("llama")
    passages = [f"Passage {i} tells how the river {i} meets the sea beyond the hills of stone. " * 3 for i in range(10)]
    rows = measure_cost(passages, tok, ks=(4, 5), repeats=2, chunk_size=16)
    assert [r.k for r in rows] == [4, 5]
    assert all(r.placed and r.cold_ms > 0 and r.empty_ms > 0 and r.chain_ms > 0 for r in rows)


def test_grammar_cost_times_plain_and_constrained_steps(tmp_path):
    from benchmarks.grammar_cost import measure_grammar_cost

    model, tok = tiny_model("llama")
    # 64 tokens a row: both rows must decode together for some steps even when a loaded machine admits the second
    # row late (8 tokens left the first row finished before the second decoded, now and then, on a busy CI host)
    config = EngineConfig(cache_dir=tmp_path, enable_cache=False, device="cpu", max_active=2, max_new_tokens=64)
    with PCREngine(model=model, tokenizer=tok, config=config) as engine:
        cost = measure_grammar_cost(rows=2, tokens=64, rounds=1, engine=engine)
        with pytest.raises(ValueError, match="max_active=2"):
            measure_grammar_cost(rows=3, tokens=8, rounds=1, engine=engine)
    # every round timed full-batch steps of both kinds, and the grammar's own time was counted
    assert cost.plain_steps >= 1 and cost.constrained_steps >= 1
    assert cost.plain_step_s > 0 and cost.constrained_step_s > 0 and cost.grammar_s_per_step > 0
    assert set(cost.as_dict()) >= {"overhead", "grammar_fraction"}


@pytest.mark.slow
def test_server_overhead_runs_on_a_tiny_model(tmp_path):
    from benchmarks.server_overhead import main

    out = tmp_path / "overhead.json"
    main(["--tiny", "--topics", "2", "--rounds", "1", "--max-tokens", "4", "--gap", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["checks"], "the run judged its targets"
