"""`pcr-rag bench` end to end on a tiny random model: every system, two rates, a window sweep, the report files."""

from __future__ import annotations

import argparse
import json

import pytest

from pcr_rag.bench import cli as bench_cli
from pcr_rag.bench.report import load_report
from pcr_rag.bench.systems import DEFAULT_SYSTEMS
from pcr_rag.cli import main
from pcr_rag.testing import tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    model, tokenizer = tiny_model("llama", seed=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = ["cache", "prefix", "tree", "chunk", "layer", "prefetch", "queue", "window", "tier", "disk", "memory", "token"]
    with path.open("w") as fh:
        for i in range(12):
            text = "\n\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(25)) for j in range(3))
            fh.write(json.dumps({"id": f"d{i}", "title": f"Doc {i}", "text": text}) + "\n")
    return path


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_quick_preset_and_overrides():
    cfg = bench_cli.config_from_args(_parse(["--quick", "--requests", "5", "--topics", "0", "--windows", "",
                                             "--systems", "pcr,no-reuse", "--rates", "0.5,inf"]))
    assert cfg.quick and cfg.num_requests == 5 and cfg.num_topics is None and cfg.windows == ()
    assert cfg.systems == ("pcr", "no-reuse") and cfg.rates == (0.5, float("inf"))
    full = bench_cli.config_from_args(_parse([]))
    assert not full.quick and full.systems == DEFAULT_SYSTEMS and full.loads == (0.4, 0.7, 1.0)


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "--systems", "nope"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["bench", "--loads", "0"]) == 2


def test_bench_cli_end_to_end(tmp_path, tiny_model_dir, corpus_file, capsys):
    out = tmp_path / "res" / "bench.json"
    rc = main(["bench", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--passage-tokens", "40",
               "--passages", "0", "--top-k", "2", "--topics", "5", "--requests", "6", "--warmup", "2",
               "--loads", "0.5,1.0", "--windows", "2", "--max-new-tokens", "3", "--chunk-size", "16",
               "--threads", "1", "--no-progress", "--json", str(out), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "what a user would see: at " in printed
    report = load_report(out)
    assert (tmp_path / "res" / "bench.md").read_text().startswith("# pcr-rag bench report")
    plots = sorted(p.name for p in (tmp_path / "res" / "bench-plots").iterdir())
    assert {"ttft_vs_rate.png", "latency_percentiles.png", "breakdown.png", "prefetch_window.png"} <= set(plots)

    runs = report["runs"]
    rates = sorted({r["rate"] for r in runs})
    assert len(rates) == 2 and rates[0] < rates[1]
    assert report["target_rate"] == rates[0]
    for rate in rates:
        assert {r["system"] for r in runs if r["rate"] == rate} >= set(DEFAULT_SYSTEMS)
    assert {r["rate"] for r in runs if r["system"] == "pcr-window-2"} == {rates[0]}
    for r in runs:
        assert r["num_requests"] == 6
        assert r["extra"]["failed_requests"] == 0
        assert 0 < r["ttft"]["p50"] <= r["ttft"]["p99"] <= r["e2el"]["p99"]
        assert set(r["hit_ratio"]) == {"device", "dram", "ssd", "remote"}
        if r["extra"]["dram_capacity_bytes"]:
            assert r["extra"]["dram_high_water_bytes"] <= r["extra"]["dram_capacity_bytes"]
    by = {(r["system"], r["rate"]): r for r in runs}
    assert by[("no-reuse", rates[0])]["reuse_ratio"] == 0.0
    assert by[("dram-only", rates[0])]["hit_ratio"]["ssd"] == 0.0
    assert by[("pcr", rates[0])]["reuse_ratio"] > 0.3  # 5 topics: most prompts are repeats
    assert by[("pcr", rates[0])]["extra"]["prefetch_window"] == 6
    # Every measured request has a new question, so cached systems write its KV back to SSD; dram-only has none.
    assert by[("pcr", rates[0])]["bytes"]["ssd_written"] > 0
    assert by[("dram-only", rates[0])]["bytes"]["ssd_written"] == by[("dram-only", rates[0])]["bytes"]["ssd_read"] == 0
    assert by[("no-reuse", rates[0])]["bytes"]["kv_stored"] == 0
    assert report["config"]["dram_capacity"] < report["config"]["ssd_capacity"]
    assert len(report["targets"]) == 4 and all("passed" in t for t in report["targets"])
    assert report["limit_ratio"] is not None and report["limit_ratio"]["ratio_dram"] > 0
    assert any(n.startswith("rates calibrated on this machine") for n in report["notes"])


def test_bench_with_real_retrieval_topics(tmp_path, corpus_file):
    from pcr_rag.bench.config import BenchConfig
    from pcr_rag.bench.serving import run_bench

    questions = tmp_path / "q.txt"
    questions.write_text("Which words are about the cache prefix tree?\nWhat about disk memory and tokens?\n")
    model, tokenizer = tiny_model("llama", seed=0)
    cfg = BenchConfig(corpus=str(corpus_file), tokens_per_passage=40, num_passages=None, top_k=2, retrieval=True,
                      questions=str(questions), num_requests=4, warmup_requests=2, rates=(50.0,), windows=(),
                      systems=("pcr",), max_new_tokens=2, chunk_size=16, threads=1, limit_ratio=False)
    report = run_bench(cfg, model=model, tokenizer=tokenizer, progress=False)
    (run,) = report["runs"]
    assert run["system"] == "pcr" and run["rate"] == 50.0 and run["num_requests"] == 4
    assert run["reuse_ratio"] > 0  # two topics, warmed: their documents are served from the cache
    assert report["config"]["retrieval"] is True
