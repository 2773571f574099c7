"""`pcr-rag simulate --validate` on a real (tiny-model) bench run: the simulator replays the bench's exact traces
through the real cache engine, so its reuse matches the measured reuse."""

from __future__ import annotations

import json

import pytest

from pcr_rag.bench.report import load_report
from pcr_rag.cli import main
from pcr_rag.sim.measure_profile import build_profile
from pcr_rag.sim.validate import bench_scenario, compare, simulate_bench
from pcr_rag.testing import tiny_loaded_model, tiny_model


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    model, tok = tiny_model("llama", seed=0)
    model_dir = root / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    corpus = root / "docs.jsonl"
    words = ["cache", "prefix", "tree", "chunk", "layer", "prefetch", "queue", "window", "tier", "disk"]
    with corpus.open("w") as fh:
        for i in range(10):
            text = "\n\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(25)) for j in range(3))
            fh.write(json.dumps({"id": f"d{i}", "title": f"Doc {i}", "text": text}) + "\n")
    out = root / "bench.json"
    rc = main(["bench", "--model", str(model_dir), "--corpus", str(corpus), "--passage-tokens", "40", "--passages",
               "0", "--top-k", "2", "--topics", "4", "--requests", "6", "--warmup", "2", "--loads", "0.5,1.0", "--repeats", "2",
               "--windows", "", "--systems", "no-reuse,dram-only,pcr", "--max-new-tokens", "3", "--chunk-size", "16",
               "--threads", "1", "--dtype", "float32", "--no-progress", "--no-limit-ratio", "--no-plots",
               "--json", str(out),
               "--work-dir", str(root / "work")])
    assert rc == 0
    return load_report(out), model_dir


@pytest.mark.slow
def test_validation_replays_the_bench_traces(bench_report, tmp_path):
    report, model_dir = bench_report
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    scenario, rates, chunk = bench_scenario(report, model=str(model_dir), tokenizer=tok)
    # every repeat's traces, repeat-major: trace rep * 2 + i is repeat rep at rate i
    assert chunk == 16 and len(rates) == 2 and len(scenario.traces) == 4
    assert all(len(t) == 6 for t in scenario.traces) and len(scenario.warmup) == 2
    measured_prompt = {r["rate"]: r["tokens"]["prompt"] for r in report["runs"] if r["system"] == "no-reuse"}
    for i, rate in enumerate(rates):  # the exact prompts of both repeats
        assert sum(r.prompt_tokens for t in scenario.traces[i::2] for r in t) == measured_prompt[rate]

    profile = build_profile(tiny_loaded_model("llama"), name="tiny", disk_dir=tmp_path, quick=True,
                            with_engine=False)
    sim = simulate_bench(report, profile, scenario, rates, chunk)
    rows = compare(report, sim)
    assert {(r.system, r.rate) for r in rows} == {(r["system"], r["rate"]) for r in report["runs"]}
    for r in rows:
        assert r.simulated_ttft_s > 0
        assert sim[(r.system, r.rate)]["num_requests"] == 12 and sim[(r.system, r.rate)]["repeats"] == 2
        assert r.error_interval is not None  # both repeats' requests pair up by (repeat, request id)
        if r.system == "no-reuse":
            assert r.simulated_reuse == r.measured_reuse == 0.0
        if r.system == "dram-only":  # no prefetch, no look-ahead: reuse depends only on the request order
            assert abs(r.simulated_reuse - r.measured_reuse) <= 0.1
