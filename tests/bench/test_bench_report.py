"""The shared report: percentile math, JSON keys, targets, breakdown, summary line, Markdown and plots."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from pcr_rag.bench.report import (
    RequestSample,
    RunRecord,
    breakdown,
    build_report,
    evaluate_targets,
    format_seconds,
    latency_summary,
    load_report,
    markdown_report,
    mid_rate,
    percentile,
    run_for,
    user_summary,
    write_json,
    write_plots,
    write_report,
)
from pcr_rag.bench.targets import RatioTarget


def sample(ttft: float, *, e2e: float | None = None, out: int = 3, prompt: int = 100, dram: int = 0,
           ssd: int = 0, queue: float = 0.0) -> RequestSample:
    e2e = ttft + 0.1 * (out - 1) if e2e is None else e2e
    return RequestSample(ttft_s=ttft, e2e_s=e2e, queue_s=queue, itl_s=tuple([0.1] * (out - 1)),
                         prompt_tokens=prompt, computed_tokens=prompt - dram - ssd,
                         reused_by_tier={"device": 0, "dram": dram, "ssd": ssd}, output_tokens=out)


def make_runs() -> list[RunRecord]:
    runs = []
    for rate, load in ((0.5, 1.0), (1.0, 2.0), (2.0, 4.0)):
        runs.append(RunRecord("no-reuse", rate, [sample(load * t) for t in (1.0, 2.0, 3.0)], duration_s=6.0))
        runs.append(RunRecord("dram-only", rate, [sample(load * t * 0.5, dram=40) for t in (1.0, 2.0, 3.0)],
                              duration_s=6.0))
        runs.append(RunRecord("ssd-on-demand", rate, [sample(load * t * 0.35, dram=40, ssd=30)
                                                      for t in (1.0, 2.0, 3.0)], duration_s=6.0))
        runs.append(RunRecord("pcr", rate, [sample(load * t * 0.3, dram=60, ssd=10) for t in (1.0, 2.0, 3.0)],
                              duration_s=6.0, prefetch_hits=4, bytes={"kv_reused_ssd": 1000},
                              extra={"prefetch_window": 6}))
        runs.append(RunRecord("pcr-no-overlap", rate, [sample(load * t * 0.4) for t in (1.0, 2.0, 3.0)],
                              duration_s=6.0))
        runs.append(RunRecord("pcr-window-2", rate, [sample(load * t * 0.33) for t in (1.0, 2.0, 3.0)],
                              duration_s=6.0, extra={"prefetch_window": 2}))
    return runs


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 95, 99, 100])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=101).tolist()
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_small_cases():
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85)
    assert math.isnan(percentile([], 50))


def test_latency_summary_keys_and_empty():
    s = latency_summary([1.0, 2.0, 3.0, 4.0])
    assert list(s) == ["mean", "p50", "p95", "p99"]
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and s["p99"] == pytest.approx(3.97)
    assert latency_summary([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_run_record_json_keys_and_values():
    run = RunRecord("pcr", 0.5, [sample(1.0, out=3, dram=50, ssd=25), sample(3.0, out=1, queue=0.5)],
                    duration_s=4.0, prefetch_hits=2, bytes={"kv_reused_ssd": 123})
    d = run.to_dict()
    for key in ("system", "rate", "num_requests", "ttft", "e2el", "itl", "tpot", "queue", "hit_ratio",
                "reuse_ratio", "tokens", "throughput_rps", "prefetch_hits", "bytes", "duration_s", "repeats",
                "requests"):
        assert key in d
    cols = d["requests"]
    assert cols["key"] == [[0, 0], [0, 1]] and cols["ttft"] == [1.0, 3.0] and cols["tpot"][1] is None
    assert cols["reused_dram"] == [50, 0] and cols["itl"] == [[0.1, 0.1], []]
    assert d["system"] == "pcr" and d["rate"] == 0.5 and d["num_requests"] == 2
    assert d["ttft"]["mean"] == 2.0
    assert d["hit_ratio"] == {"device": 0.0, "dram": 0.25, "ssd": 0.125, "remote": 0.0}
    assert d["reuse_ratio"] == pytest.approx(0.375)
    assert d["tpot"]["mean"] == pytest.approx(0.1)  # one-token request has no TPOT
    assert d["itl"]["p50"] == pytest.approx(0.1)
    assert d["queue"]["mean"] == 0.25
    assert d["prefill"]["mean"] == 0.0 and cols["prefill_compute"] == [0.0, 0.0] and cols["load_wait"] == [0.0, 0.0]
    assert d["throughput_rps"] == 0.5
    assert d["tokens"] == {"prompt": 200, "computed": 125, "reused": 75, "output": 4}
    split = dataclasses.replace(sample(1.0), prefill_s=0.8, prefill_compute_s=0.5, load_wait_s=0.1)
    e = RunRecord("pcr", 0.5, [split], duration_s=1.0).to_dict()
    assert e["prefill"]["mean"] == 0.8 and e["prefill_compute"]["mean"] == 0.5
    assert e["requests"]["load_wait"] == [0.1]


def test_merge_repeats_and_inf_rate():
    a = RunRecord("pcr", math.inf, [sample(1.0)], duration_s=1.0)
    b = RunRecord("pcr", math.inf, [sample(2.0)], duration_s=3.0, prefetch_hits=1)
    report = build_report([a, b], kind="bench")
    (run,) = report["runs"]
    assert run["rate"] == "inf" and run["repeats"] == 2 and run["num_requests"] == 2
    assert run["throughput_rps"] == 0.5 and run["prefetch_hits"] == 1
    with pytest.raises(ValueError):
        a.merge(RunRecord("no-reuse", math.inf))


def test_build_report_targets_breakdown_summary(tmp_path):
    targets = [RatioTarget("mean", "pcr", "no-reuse", "ttft.mean", 0.4),
               RatioTarget("vs dram", "pcr", "dram-only", "ttft.mean", 0.5),
               RatioTarget("missing", "pcr", "nothing", "ttft.mean", 1.0)]
    report = build_report(make_runs(), kind="bench", config={"quick": True}, targets=targets,
                          limit_ratio={"dram": 1.05}, notes=["a note"])
    assert mid_rate(report) == 1.0 and report["target_rate"] == 1.0
    res = {t["name"]: t for t in report["targets"]}
    assert res["mean"]["ratio"] == pytest.approx(0.3) and res["mean"]["passed"] is True
    assert res["vs dram"]["ratio"] == pytest.approx(0.6) and res["vs dram"]["passed"] is False
    assert res["missing"]["passed"] is False and res["missing"]["ratio"] is None
    rows = [r for r in report["breakdown"] if r["rate"] == 1.0]
    overlap = next(r for r in rows if r["without"] == "pcr-no-overlap")
    assert overlap["reduction"] == pytest.approx(0.25)  # (0.4 - 0.3) / 0.4
    assert any(r["without"] == "ssd-on-demand" for r in rows)
    # every request of pcr is 0.3x its no-reuse twin: the interval collapses to the point, and is significant
    assert report["summary"].startswith("at 1 req/s, pcr: mean TTFT 1.20 s vs no-reuse 4.00 s (3.33x faster "
                                        "[3.33-3.33])")
    assert res["mean"]["ci_low"] == pytest.approx(0.3) and res["mean"]["ci_high"] == pytest.approx(0.3)
    assert res["missing"]["missing"] == "nothing not run at this rate"
    path = write_json(report, tmp_path / "r.json")
    loaded = load_report(path)
    assert loaded["runs"][0].keys() == report["runs"][0].keys()
    assert json.loads(path.read_text())["limit_ratio"] == {"dram": 1.05}
    with pytest.raises(ValueError):
        (tmp_path / "x.json").write_text('{"runs": []}')
        load_report(tmp_path / "x.json")


def test_evaluate_targets_at_explicit_rate():
    report = build_report(make_runs(), kind="bench")
    (res,) = evaluate_targets(report, [RatioTarget("t", "pcr", "no-reuse", "ttft.p99", 0.31)], rate=2.0)
    assert res.rate == 2.0 and res.passed and res.ratio == pytest.approx(0.3)
    assert "PASS" in res.line()
    assert run_for(report, "pcr", 3.0) is None
    assert breakdown(report, 3.0) == []


def test_user_summary_missing_system():
    report = build_report([RunRecord("no-reuse", 1.0, [sample(1.0)], duration_s=1.0)], kind="bench")
    assert "pcr was not run" in user_summary(report)


def test_markdown_and_plots(tmp_path):
    report = build_report(make_runs(), kind="bench", targets=[RatioTarget("m", "pcr", "no-reuse")],
                          limit_ratio={"dram": 1.05})
    md = markdown_report(report)
    assert "| pcr |" in md and "## 1 req/s" in md and "Breakdown" in md and "[PASS] m" in md
    assert "## Ratios with 95% bootstrap intervals" in md and "## Answers" not in md  # no answers recorded
    assert "Limit ratio" in md
    out = write_report(report, json_path=tmp_path / "r.json", markdown_path=tmp_path / "r.md",
                       plot_dir=tmp_path / "plots")
    names = sorted(p.name for p in out["plots"])
    assert names == ["breakdown.png", "hit_ratio.png", "latency_percentiles.png", "prefetch_window.png",
                     "ttft_vs_rate.png"]
    for p in out["plots"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert out["markdown"].read_text() == md
    assert write_plots(build_report([], kind="bench"), tmp_path / "none") == []


def test_format_seconds():
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(None) == "n/a"


def test_sample_from_metrics_duck_typed():
    class M:
        ttft_s, e2e_s, queue_s, itl_s = 0.5, 0.9, 0.1, [0.2, 0.2]
        prompt_tokens, computed_tokens, reused_by_tier, generated_tokens = 10, 4, {"dram": 6}, 3

    s = RequestSample.from_metrics(M())
    assert s.reused_by_tier == {"device": 0, "dram": 6, "ssd": 0, "remote": 0}
    assert s.output_tokens == 3 and s.tpot_s == pytest.approx(0.2)


def test_skipped_aliases_and_caveat_in_the_report():
    runs = [RunRecord("pcr", 1.0, [sample(1.0), sample(2.0)], duration_s=2.0),
            RunRecord("no-reuse", 1.0, [sample(2.0), sample(4.0)], duration_s=2.0)]
    report = build_report(runs, kind="bench", aliases={"pcr-schedule-fcfs": "pcr"},
                          skipped={"llama-cpp": "llama_cpp is not importable"}, caveat="indicative only",
                          targets=[RatioTarget("vs llama", "pcr", "llama-cpp"),
                                   RatioTarget("alias", "pcr-schedule-fcfs", "no-reuse", max_ratio=0.6)])
    res = {t["name"]: t for t in report["targets"]}
    assert res["vs llama"]["missing"] == "llama-cpp skipped: llama_cpp is not importable"
    assert res["alias"]["ratio"] == pytest.approx(0.5) and res["alias"]["passed"]  # the alias is pcr's run
    md = markdown_report(report)
    assert md.splitlines()[2] == "> **indicative only**"
    assert "`llama-cpp` skipped: llama_cpp is not importable" in md
    assert "`pcr-schedule-fcfs` has the same configuration as `pcr`" in md
    assert "[NOT RUN] vs llama: not measured (llama-cpp skipped" in md  # not run is not a miss
