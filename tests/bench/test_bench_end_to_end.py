"""`pcr-rag bench` end to end on a tiny random model: every system, two rates, a window sweep, the report files."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pcr_rag.bench import cli as bench_cli
from pcr_rag.bench.report import load_report
from pcr_rag.bench.systems import BENCH_DEFAULT_SYSTEMS, DEFAULT_SYSTEMS
from pcr_rag.cli import main
from pcr_rag.config import EngineConfig
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
    assert not full.quick and full.systems == BENCH_DEFAULT_SYSTEMS and full.loads == (0.4, 0.7, 1.0)
    assert full.order == "relevance" and full.saturation == () and cfg.saturation == (1, 8)


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "--systems", "nope"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["bench", "--loads", "0"]) == 2


def test_bench_cli_end_to_end(tmp_path, tiny_model_dir, corpus_file, capsys):
    out = tmp_path / "res" / "bench.json"
    rc = main(["bench", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--passage-tokens", "40",
               "--passages", "0", "--top-k", "2", "--topics", "5", "--requests", "6", "--warmup", "2",
               "--loads", "0.5,1.0", "--windows", "2", "--saturation", "1,8", "--max-new-tokens", "3",
               "--chunk-size", "16", "--threads", "1", "--no-progress", "--json", str(out),
               "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "what a user would see: at " in printed and "indicative only" not in printed
    report = load_report(out)
    assert (tmp_path / "res" / "bench.md").read_text().startswith("# pcr-rag bench report")
    plots = sorted(p.name for p in (tmp_path / "res" / "bench-plots").iterdir())
    assert {"ttft_vs_rate.png", "latency_percentiles.png", "breakdown.png", "prefetch_window.png"} <= set(plots)

    runs = report["runs"]
    rates = sorted({r["rate"] for r in runs if r["rate"] != "inf"})
    assert len(rates) == 2 and rates[0] < rates[1]
    assert report["target_rate"] == rates[0]
    # the schedule pair runs where the engine has the option (the default schedule's twin is an alias of pcr)
    schedules = {n for n in ("pcr-schedule-fcfs", "pcr-schedule-cache-aware")
                 if n not in report["aliases"] and n not in {s["system"] for s in report["skipped"]}}
    for rate in rates:
        expected = {*DEFAULT_SYSTEMS, "transformers", *schedules} | ({"pcr-window-2"} if rate == rates[0] else set())
        assert {r["system"] for r in runs if r["rate"] == rate} == expected
    assert {r["rate"] for r in runs if r["system"] == "pcr-window-2"} == {rates[0]}
    # saturation: both max_active engines on one trace sent at once, their throughput ratio with an interval
    sat = {r["system"]: r for r in runs if r["rate"] == "inf"}
    assert set(sat) == {"pcr-max-active-1", "pcr-max-active-8"}
    assert sat["pcr-max-active-1"]["extra"]["max_active"] == 1 and sat["pcr-max-active-8"]["extra"]["max_active"] == 8
    (thr,) = [r for r in report["ratios"] if r["stat"] == "throughput_rps"]
    assert thr["system"] == "pcr-max-active-8" and thr["ratio"] > 0 and thr["low"] <= thr["ratio"] <= thr["high"]
    skipped = {s["system"]: s["reason"] for s in report["skipped"]}
    assert "llama-cpp" in skipped  # not importable, or (when installed) no GGUF for a directory model
    if "schedule" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        assert skipped["pcr-schedule-fcfs"].endswith("has no schedule option")
    else:  # one of the pair is the engine's default: the same configuration as pcr, run once
        default = EngineConfig.__dataclass_fields__["schedule"].default
        assert report["aliases"][f"pcr-schedule-{default}"] == "pcr" and len(schedules) == 1
    # every request of every system is keyed by (repeat, trace index) and paired across systems
    keys = {tuple(map(tuple, r["requests"]["key"])) for r in runs if r["rate"] == rates[0]}
    assert len(keys) == 1
    assert all(a["equal"] == a["n"] for a in report["answers"] if a["system"] != "transformers")  # exact cache
    for r in runs:
        assert r["num_requests"] == 6
        assert r["extra"]["failed_requests"] == 0
        assert set(r["extra"]["gc_collections"]) == {"0", "1", "2"} and r["extra"]["gc_pause_s"] >= 0
        assert 0 < r["ttft"]["p50"] <= r["ttft"]["p99"] <= r["e2el"]["p99"]
        assert set(r["hit_ratio"]) == {"device", "dram", "ssd", "remote"}
        if r["extra"].get("dram_capacity_bytes"):
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
    assert len(report["targets"]) == 8 and all("passed" in t for t in report["targets"])
    assert all(t["ci_high"] is not None for t in report["targets"] if t["ratio"] is not None)
    assert any(n.startswith("reuse bound of the workload") for n in report["notes"])
    assert report["limit_ratio"] is not None and report["limit_ratio"]["ratio_dram"] > 0
    assert any(n.startswith("rates calibrated on this machine") for n in report["notes"])
    # the admission bound: per finite rate, from the fcfs run's own requests (in the JSON, the notes, the page)
    bounds = {b["rate"]: b for b in report["schedule_bound"]}
    assert set(bounds) == set(rates) and all(b["requests"] == 6 for b in bounds.values())
    assert all(0 < b["best_mean_s"] <= b["fcfs_mean_s"] * (1 + 1e-9) and b["ratio"] <= 1 + 1e-9
               for b in bounds.values())
    assert any(n.startswith("admission bound: at ") for n in report["notes"])
    assert "## Admission bound" in (tmp_path / "res" / "bench.md").read_text()


def test_bench_with_real_retrieval_topics(tmp_path, corpus_file):
    from pcr_rag.bench.config import BenchConfig
    from pcr_rag.bench.serving import run_bench

    questions = tmp_path / "q.txt"
    questions.write_text("Which words are about the cache prefix tree?\nWhat about disk memory and tokens?\n")
    model, tokenizer = tiny_model("llama", seed=0)
    cfg = BenchConfig(corpus=str(corpus_file), tokens_per_passage=40, num_passages=None, top_k=2, retrieval=True,
                      questions=str(questions), num_requests=4, warmup_requests=2, rates=(50.0,), windows=(),
                      saturation=(), systems=("pcr",), max_new_tokens=2, chunk_size=16, threads=1,
                      limit_ratio=False)
    report = run_bench(cfg, model=model, tokenizer=tokenizer, progress=False)
    (run,) = report["runs"]
    assert run["system"] == "pcr" and run["rate"] == 50.0 and run["num_requests"] == 4
    assert run["reuse_ratio"] > 0  # two topics, warmed: their documents are served from the cache
    assert report["config"]["retrieval"] is True
    assert any("no gold passages" in n for n in report["notes"])


@pytest.fixture(scope="module")
def markdown_corpus(tmp_path_factory):
    """Markdown documents with headings: the questions are generated from them."""
    root = tmp_path_factory.mktemp("md")
    topics = ["Cache tiers", "Prefix trees", "Prefetch windows", "Eviction policy", "Chunk keys", "Write back"]
    for i, t in enumerate(topics):
        body = " ".join(f"{t.lower().replace(' ', '_')}{k}" for k in range(30))
        (root / f"doc{i}.md").write_text(f"# {t}\n\n{body}\n\n## {t} in practice\n\n{body} practice\n")
    return root


def test_retrieval_with_generated_questions_and_both_orders(markdown_corpus):
    """--retrieval without --questions: questions from the corpus's headings with gold passages, cached systems in
    cache-aware order and pcr@relevance beside them; the report has the retrieval targets, hit@k, reuse bounds
    and answer agreement between the orders."""
    cfg = bench_cli.config_from_args(_parse(["--retrieval", "--corpus", str(markdown_corpus), "--passage-tokens",
                                             "30", "--passages", "0", "--top-k", "2", "--requests", "6",
                                             "--warmup", "2", "--rates", "20", "--windows", "", "--saturation", "",
                                             "--max-new-tokens", "2", "--chunk-size", "16", "--threads", "1",
                                             "--no-limit-ratio"]))
    assert cfg.retrieval and cfg.order == "cache-aware" and cfg.systems[-1] == "pcr@relevance"
    from pcr_rag.bench.serving import run_bench

    model, tokenizer = tiny_model("llama", seed=0)
    cfg = dataclasses.replace(cfg, systems=("no-reuse", "dram-only", "pcr", "pcr@relevance"))
    report = run_bench(cfg, model=model, tokenizer=tokenizer, progress=False)
    names = {r["system"] for r in report["runs"]}
    assert names == {"no-reuse", "dram-only", "pcr", "pcr@relevance"}
    by = {r["system"]: r for r in report["runs"]}
    assert by["pcr"]["extra"]["order"] == "cache-aware" and by["pcr@relevance"]["extra"]["order"] == "relevance"
    assert by["no-reuse"]["extra"]["order"] is None
    info = report["config"]["working_set"]
    assert info["generated_questions"] and info["questions"] == 12 and info["hit_at_k"] is not None
    assert set(info["reuse_bound_by_order"]) == {"relevance", "cache-aware"}
    targets = {t["name"]: t for t in report["targets"]}
    gain = next(t for t in targets.values() if t["baseline"] == "pcr@relevance")
    assert gain["ratio"] is not None and gain["min_ratio"] == 1.5  # measured, pass or not
    assert any("not run" in (t.get("missing") or "") for t in targets.values())  # ssd-on-demand was not run
    assert report["aliases"].get("pcr@cache-aware") == "pcr"
    agree = next(a for a in report["answers"] if a["system"] == "pcr@relevance" and a["baseline"] == "pcr")
    assert 0 <= agree["equal"] <= agree["n"] == 6 and agree["checked"] == 6
    assert any(n.startswith("answer agreement pcr@relevance vs pcr") for n in report["notes"])
    assert any("hit@2" in n for n in report["notes"])


def test_cache_aware_order_comes_from_the_engine_when_it_has_order_for_reuse(monkeypatch, corpus_file):
    """With ``PCREngine.order_for_reuse`` (the lead's runtime) the bench asks the engine at submission instead of
    using its offline order."""
    from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig
    from pcr_rag.bench.serving import run_bench
    from pcr_rag.engine import PCREngine

    calls: list[tuple[int, str | None]] = []

    def order_for_reuse(self, documents, *, system=None):
        calls.append((len(documents), system))
        return list(reversed(documents))

    monkeypatch.setattr(PCREngine, "order_for_reuse", order_for_reuse, raising=False)
    model, tokenizer = tiny_model("llama", seed=0)
    cfg = BenchConfig(corpus=str(corpus_file), tokens_per_passage=40, num_passages=None, top_k=2, num_topics=3,
                      num_requests=4, warmup_requests=2, rates=(50.0,), windows=(), systems=("no-reuse", "pcr"),
                      order="cache-aware", max_new_tokens=2, chunk_size=16, threads=1, limit_ratio=False)
    report = run_bench(cfg, model=model, tokenizer=tokenizer, progress=False)
    by = {r["system"]: r for r in report["runs"]}
    assert by["pcr"]["extra"]["order_source"] == "engine.order_for_reuse"
    assert len(calls) == 6 and set(calls) == {(2, SYSTEM_PROMPT)}  # warm-up (2) + measured (4), pcr only
    assert any("the engine's order_for_reuse" in n for n in report["notes"])
