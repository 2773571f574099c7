"""`pcr-rag bench --trace`: a trace becomes bench traces (arrivals scaled, exact token counts, warm-up of its own),
bad arguments and bad lines exit 2, and an end-to-end replay of the example trace on a tiny model reports the
bounds next to what no-reuse and pcr reached."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig, BenchError
from pcr_rag.bench.report import load_report
from pcr_rag.bench.trace_file import parse_trace, read_trace
from pcr_rag.bench.trace_replay import TRACE_SYSTEMS, build_replay, output_tokens, replay_rate, trace_config
from pcr_rag.bench.workload import with_rate
from pcr_rag.cli import main
from pcr_rag.prompt import PromptBuilder
from pcr_rag.testing import save_tiny_model, tiny_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "example_rag.jsonl"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


def _trace(*timestamps, tokens=12):
    return parse_trace([json.dumps({"timestamp": t, "segments": [
        {"kind": "system", "id": "s", "tokens": tokens}, {"kind": "passage", "id": f"p{i % 2}", "tokens": tokens},
        {"kind": "question", "id": f"q{i}", "tokens": 4}]}) for i, t in enumerate(timestamps)])


def test_replay_traces_scale_arrivals_and_count_exact_tokens():
    trace = _trace(1000, 1500, 3000, 5000)
    cfg = trace_config(BenchConfig(chunk_size=16, max_new_tokens=2), trace, speed=2.0)
    assert cfg.systems == TRACE_SYSTEMS and cfg.repeats == 1 and cfg.saturation == () and not cfg.limit_ratio
    assert cfg.num_requests == 4 and cfg.warmup_requests == 2 and cfg.rates == (pytest.approx(1.5),)  # 3 gaps in 2 s
    tok = tiny_tokenizer()
    replay = build_replay(trace, cfg, tok, kv_bytes_per_token=10, speed=2.0)
    (measured,) = replay.traces.unit_traces.values()
    # the runner scales the stored (1 req/s) arrivals by the run's rate: the trace's gaps divided by the speed
    assert [r.arrival_s for r in with_rate(measured, cfg.rates[0])] == pytest.approx([0.0, 0.25, 1.0, 2.0])
    builder = PromptBuilder(tok)
    for req, laid in zip(measured, replay.bounds.served, strict=True):
        docs = replay.traces.documents(req)
        assert laid.segments == builder.build_rag(req.question, docs, SYSTEM_PROMPT).segments  # the engine's layout
        assert len(docs) == 2 and len(tok(docs[1], add_special_tokens=False)["input_ids"]) == 12
    assert measured[0].doc_ids[1] == measured[2].doc_ids[1] != measured[1].doc_ids[1]  # same id, same document
    # warm-up: shaped like the first request, none of its ids
    assert len(replay.traces.warmup) == 2
    assert not set(replay.traces.warmup[0].doc_ids) & {d for r in measured for d in r.doc_ids}
    assert replay.info["requests"] == 4 and replay.info["synthetic_text"]["max_abs_error"] == 0
    assert replay.traces.ws_bytes == replay.bounds.stored_tokens * 10


def test_replay_drops_what_does_not_fit_and_all_at_once():
    short, long = _trace(0, 0, tokens=12), _trace(0, tokens=40)
    trace = parse_trace([json.dumps({"timestamp": 0, "segments": [{"kind": s.kind, "id": s.id, "tokens": s.tokens}
                                                                  for s in r.segments]})
                         for r in (*short.requests, *long.requests)])
    assert math.isinf(replay_rate(trace, 1.0)) and math.isinf(replay_rate(_trace(0, 100), float("inf")))
    cfg = trace_config(BenchConfig(chunk_size=16, max_new_tokens=2), trace)
    tok = tiny_tokenizer()
    fits = max(laid.num_tokens for laid in build_replay(trace.head(2), cfg, tok, 1).bounds.served)
    replay = build_replay(trace, cfg, tok, 1, context_tokens=fits + 2)  # the two short ones fit, the long one not
    assert replay.info["dropped_too_long"] == 1 and len(replay.trace.requests) == 2
    assert [r.line for r in replay.trace.requests] == [1, 2]
    with pytest.raises(BenchError, match="no request of"):
        build_replay(trace, cfg, tok, 1, context_tokens=10)


def test_each_request_generates_its_traces_output_length():
    lines = [json.dumps({"timestamp": 0, "output_length": out, "segments": [
        {"kind": "passage", "id": "p", "tokens": 12}, {"kind": "question", "id": f"q{i}", "tokens": 4}]})
        for i, out in enumerate((40, 0))]
    trace = parse_trace([*lines, json.dumps({"timestamp": 0, "segments": [{"kind": "question", "id": "q", "tokens": 4}]})])
    assert [output_tokens(r, 7) for r in trace.requests] == [40, 1, 7]  # a first token at least; none: the default
    assert [r.output_length for r in trace.scaled(0.5).requests] == [20, 1, None]
    cfg = trace_config(BenchConfig(chunk_size=16, max_new_tokens=7), trace)
    replay = build_replay(trace, cfg, tiny_tokenizer(), 1)
    (measured,) = replay.traces.unit_traces.values()
    assert [r.max_new_tokens for r in measured] == [40, 1, 7]
    fits = max(laid.num_tokens for laid in replay.bounds.served)
    assert len(build_replay(trace, cfg, tiny_tokenizer(), 1, context_tokens=fits + 8).trace.requests) == 2  # 40 not


def test_mooncake_replays_blocks_as_documents():
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 1100, "output_length": 8, "hash_ids": [7, 8 + i, 20 + i]})
             for i in range(3)]
    trace = parse_trace(lines).scaled(1 / 32)
    cfg = trace_config(BenchConfig(chunk_size=16, max_new_tokens=2), trace)
    replay = build_replay(trace, cfg, tiny_tokenizer(), 1)
    (measured,) = replay.traces.unit_traces.values()
    assert all(r.question == "" and len(r.doc_ids) == 3 for r in measured)  # the blocks are the prompt
    assert measured[0].doc_ids[0] == measured[2].doc_ids[0] and measured[0].doc_ids[1] != measured[1].doc_ids[1]
    b = replay.bounds
    assert b.prefix.reused[1] > 0 and b.position_independent == b.prefix and b.cache_aware is None
    assert replay.info["format"] == "mooncake" and replay.info["output_length_mean"] == 1  # 8 / 32, at least 1


def test_trace_config_refuses_what_a_replay_cannot_do():
    trace = _trace(0, 10)
    with pytest.raises(BenchError, match="does not combine"):
        trace_config(BenchConfig(quick=True), trace)
    with pytest.raises(BenchError, match="cache-aware order is reported as a bound"):
        trace_config(BenchConfig(systems=("pcr@cache-aware",)), trace, systems_given=True)
    with pytest.raises(BenchError, match="--trace-speed must be > 0"):
        trace_config(BenchConfig(), trace, speed=0.0)


def test_bad_trace_arguments_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "segments": [{"kind": "passage", "id": "p", "tokens": 3}]}\n{"timestamp": 1}\n')
    assert main(["bench", "--trace", str(bad)]) == 2
    assert f"{bad}, line 2: neither a RAG trace request" in capsys.readouterr().err
    assert main(["bench", "--trace", str(EXAMPLE), "--quick"]) == 2
    assert "does not combine" in capsys.readouterr().err
    assert main(["bench", "--trace", str(EXAMPLE), "--trace-length-scale", "0"]) == 2
    assert "--trace-length-scale must be > 0" in capsys.readouterr().err


def test_bench_trace_end_to_end(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "res" / "trace.json"
    rc = main(["bench", "--trace", str(EXAMPLE), "--requests", "3", "--trace-speed", "50",
               "--trace-length-scale", "0.2", "--model", str(tiny_model_dir), "--chunk-size", "16",
               "--max-new-tokens", "2", "--threads", "1", "--no-progress", "--no-plots", "--json", str(out),
               "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    assert "## Trace replay: reuse bounds vs what each system reached" in capsys.readouterr().out
    report = load_report(out)
    assert {r["system"] for r in report["runs"]} == set(TRACE_SYSTEMS)
    assert all(r["num_requests"] == 3 and r["extra"]["failed_requests"] == 0 for r in report["runs"])
    section = report["bounds"]
    rows = section["bounds"]
    assert set(rows) == {"no_reuse", "prefix", "prefix_moved", "cache_aware", "position_independent"}
    # the example's per-request system part before the passages: moving it, reordering and position
    # independence each reach more than the exact prefix as served
    prefix = rows["prefix"]["fraction"]
    assert 0 < prefix < rows["position_independent"]["fraction"] <= 1
    assert rows["prefix_moved"]["fraction"] >= prefix and rows["cache_aware"]["fraction"] >= prefix
    assert all(rows[k]["ttft_bound_s"] > 0 for k in rows)  # a raw forward was timed and fitted
    assert len(section["raw_forward"]["points"]) >= 3
    reached = {r["system"]: r for r in section["reached"]}
    assert reached["no-reuse"]["reuse"] == 0
    assert reached["pcr"]["reuse"] <= prefix + 1e-9  # exact reuse never beats an unbounded exact prefix cache
    assert all(r["prompt_tokens_as_laid_out"] for r in reached.values())  # the bounds' layout is the engine's
    assert section["trace"]["requests"] == 3 and section["trace"]["file"] == str(EXAMPLE)
    assert report["config"]["working_set"]["trace"]["format"] == "rag"
    assert all(a["equal"] == a["n"] for a in report["answers"])  # pcr's answers are no-reuse's
    md = (tmp_path / "res" / "trace.md").read_text()
    assert "| pcr |" in md and "position-independent (any segment seen before" in md
    assert read_trace(EXAMPLE).requests[0].line == 1


def test_bench_trace_with_blend_counts_placed_reuse_end_to_end(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "blend.json"
    rc = main(["bench", "--trace", str(EXAMPLE), "--requests", "4", "--trace-speed", "50",
               "--trace-length-scale", "0.2", "--model", str(tiny_model_dir), "--chunk-size", "16",
               "--systems", "no-reuse,pcr,pcr-blend", "--max-new-tokens", "2", "--threads", "1", "--no-progress",
               "--no-plots", "--json", str(out), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    assert "### Blend mode against its targets" in capsys.readouterr().out
    report = load_report(out)
    runs = {r["system"]: r for r in report["runs"]}
    blend_run = runs["pcr-blend"]
    tokens = blend_run["tokens"]
    # every prompt token is computed, reused exactly or placed; the bench split every placed token
    assert tokens["computed"] + tokens["reused"] + tokens["blended"] == tokens["prompt"]
    assert blend_run["extra"]["blend_inconsistent"] == 0 and blend_run["extra"]["ssd_evictions"] == 0
    # the engine counts as blended either every placed token or only those placed from earlier KV
    assert tokens["blended"] in (tokens["blended_reused"], tokens["blended_reused"] + tokens["blended_fresh"])
    # the example's second request repeats a passage of the first after a new per-request part: placed from KV
    # the first left; every passage's first use was computed for its own request
    assert tokens["blended_reused"] > 0 and tokens["blended_fresh"] > 0
    section = report["bounds"]
    reached = {r["system"]: r for r in section["reached"]}
    b = reached["pcr-blend"]
    assert b["reuse"] == pytest.approx(b["exact_reuse"] + b["blended_reused"])
    assert b["blended_reused"] == pytest.approx(tokens["blended_reused"] / tokens["prompt"])
    assert b["reuse"] > reached["pcr"]["reuse"] == reached["pcr"]["exact_reuse"]  # blend reuses beyond the prefix
    pi = section["bounds"]["position_independent"]["fraction"]
    assert b["reuse"] <= pi + 1e-9  # what it placed was seen before: never above the position-independent bound
    assert b["reuse_over_position_independent_bound"] == pytest.approx(b["reuse"] / pi)
    (row,) = section["blend"]
    assert row["system"] == "pcr-blend" and row["recompute"] == pytest.approx(0.15)
    for key in ("limit_ratio", "limit_ratio_prefill", "limit_ratio_own_compute", "ttft_vs_pcr", "ttft_vs_no_reuse"):
        assert row[key]["low"] <= row[key]["ratio"] <= row[key]["high"] and row[key]["n"] == 4
    assert row["limit_ratio"]["ratio"] == pytest.approx(blend_run["ttft"]["mean"] / row["raw_forward_mean_s"])
    assert row["ttft_vs_pcr"]["ratio"] == pytest.approx(blend_run["ttft"]["mean"] / runs["pcr"]["ttft"]["mean"])
    # on the tiny model at these lengths attention over the context is within timing noise, and the fit keeps its
    # coefficients non-negative, so the share may be exactly 0 here (test_blend_ledger checks it on a known fit)
    assert 0 <= row["attention_share_full_prefill"] < 1 and row["compute_spans_mean"] >= 1
    assert set(row["targets"]) == {"reuse_over_position_independent", "limit_ratio", "ttft_vs_pcr"}
    assert all(t["passed"] in (True, False) for t in row["targets"].values())
    assert report["config"]["working_set"]["trace"]["blend_store_tokens"] > 0
