"""Bootstrap intervals: they cover the truth at about their level, pair by request key, and flag what is not
significant; targets are judged on the interval's unfavourable end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pcr_rag.bench.report import RequestSample, RunRecord, build_report, evaluate_targets, markdown_report
from pcr_rag.bench.stats import (
    RatioInterval,
    RequestTable,
    mean_interval,
    paired_ratio_interval,
    requests_to_resolve,
    statistic,
    throughput_ratio_interval,
)
from pcr_rag.bench.targets import RatioTarget


def table(ttft, *, keys=None, itl=None, prompt=None, reused=None, arrival=None, e2el=None) -> RequestTable:
    n = len(ttft)
    cols = {
        "key": keys or [[0, i] for i in range(n)],
        "ttft": list(ttft),
        "e2el": list(e2el if e2el is not None else ttft),
        "queue": [0.0] * n,
        "tpot": [None] * n,
        "itl": itl or [[] for _ in range(n)],
        "prompt_tokens": prompt or [100] * n,
        "reused_device": [0] * n,
        "reused_dram": reused or [0] * n,
        "reused_ssd": [0] * n,
        "reused_remote": [0] * n,
        "arrival": arrival or [0.0] * n,
    }
    return RequestTable.from_run({"requests": cols})


def paired_sample(rng: np.random.Generator, n: int, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Baseline per-request times ~ lognormal (heavy-ish tail); system = ratio x baseline x mean-1 noise, so the
    true ratio of means is exactly ``ratio``."""
    b = rng.lognormal(mean=0.0, sigma=0.6, size=n)
    noise = rng.gamma(shape=8.0, scale=1 / 8.0, size=n)  # mean 1
    return ratio * b * noise, b


def test_interval_covers_the_true_ratio_at_about_its_level():
    rng = np.random.default_rng(1)
    truth = 0.8
    covered = 0
    trials = 200
    for t in range(trials):
        a, b = paired_sample(rng, 60, truth)
        ci = paired_ratio_interval(table(a), table(b), "ttft.mean", resamples=1000, seed=t)
        assert ci is not None and ci.low <= ci.ratio <= ci.high
        covered += ci.low <= truth <= ci.high
    assert 0.88 <= covered / trials <= 0.99, covered


def test_interval_narrows_with_more_requests():
    rng = np.random.default_rng(2)
    widths = []
    for n in (20, 80, 320):
        a, b = paired_sample(rng, n, 0.9)
        ci = paired_ratio_interval(table(a), table(b), "ttft.mean", resamples=1000)
        widths.append(ci.high - ci.low)
    assert widths[0] > widths[1] > widths[2]


def test_significance_flag():
    rng = np.random.default_rng(3)
    a, b = paired_sample(rng, 40, 1.0)
    same = paired_ratio_interval(table(a), table(b), "ttft.mean")
    assert same.low < 1.0 < same.high and not same.significant
    a, b = paired_sample(rng, 40, 0.5)
    half = paired_ratio_interval(table(a), table(b), "ttft.mean")
    assert half.high < 1.0 and half.significant
    assert RatioInterval(1.2, 1.05, 1.3, 10).significant
    assert RatioInterval(1.0, 0.9, 1.1, 10).text() == "1.00x [0.90, 1.10]"


def test_pairs_by_key_not_by_position():
    rng = np.random.default_rng(4)
    a, b = paired_sample(rng, 30, 0.7)
    keys = [[0, i] for i in range(30)]
    perm = rng.permutation(30)
    shuffled = table(a[perm], keys=[keys[i] for i in perm])
    assert paired_ratio_interval(shuffled, table(b), "ttft.mean") == paired_ratio_interval(table(a), table(b),
                                                                                           "ttft.mean")
    # pairing matters: the paired interval is narrower than if the pairs were broken
    broken = table(a[perm])
    assert (paired_ratio_interval(table(a), table(b), "ttft.mean").high
            - paired_ratio_interval(table(a), table(b), "ttft.mean").low) < (
        paired_ratio_interval(broken, table(b), "ttft.mean").high
        - paired_ratio_interval(broken, table(b), "ttft.mean").low)
    # only keys both runs hold are paired
    part = table(a[:10], keys=keys[:10])
    assert paired_ratio_interval(part, table(b), "ttft.mean").n == 10
    assert paired_ratio_interval(table([1.0]), table([2.0]), "ttft.mean") is None


def test_statistics():
    t = table([1.0, 2.0, 3.0, 4.0], itl=[[0.1], [0.1, 0.3], [], [0.2]], prompt=[100, 100, 100, 100],
              reused=[50, 0, 100, 0])
    rows = np.arange(4)[None, :]
    assert statistic("ttft.mean")(t, rows)[0] == pytest.approx(2.5)
    assert statistic("ttft.p50")(t, rows)[0] == pytest.approx(2.5)
    assert statistic("itl.mean")(t, rows)[0] == pytest.approx(0.175)  # pooled gaps, not per request
    assert statistic("reuse_ratio")(t, rows)[0] == pytest.approx(0.375)  # ratio of sums
    assert statistic("hit_ratio.dram")(t, rows)[0] == pytest.approx(0.375)
    assert statistic("hit_ratio.ssd")(t, rows)[0] == 0.0
    assert statistic("tpot.mean")(t, rows)[0] != statistic("tpot.mean")(t, rows)[0]  # all undefined -> NaN
    with pytest.raises(ValueError, match="no bootstrap statistic"):
        statistic("ttft.p42")
    # one system's own ITL P99 / P50 (a baseline_stat)
    ci = paired_ratio_interval(t, t, "itl.p99", baseline_stat="itl.p50")
    assert ci.ratio == pytest.approx(np.percentile([0.1, 0.1, 0.3, 0.2], 99) / 0.15)


def test_throughput_interval_over_completion_gaps():
    # a: 10 requests completing every 0.5 s; b: every 1.0 s -> a has twice b's throughput
    a = table([0.1] * 10, e2el=[0.5 * (i + 1) for i in range(10)])
    b = table([0.1] * 10, e2el=[1.0 * (i + 1) for i in range(10)])
    ci = throughput_ratio_interval(a, b)
    assert ci.ratio == pytest.approx(2.0) and not ci.paired
    assert ci.low == pytest.approx(2.0) and ci.high == pytest.approx(2.0)  # equal gaps: no spread
    assert paired_ratio_interval(a, b, "throughput_rps") == ci


def test_mean_interval_covers_the_true_mean_and_narrows():
    rng = np.random.default_rng(3)
    covered = 0
    for trial in range(200):
        low, high = mean_interval(rng.exponential(1.0, 40).tolist(), resamples=400, seed=trial)
        covered += low <= 1.0 <= high
    assert 0.85 <= covered / 200 <= 0.99  # about its 95% level (percentile bootstrap, skewed data: a little under)
    wide = mean_interval(rng.exponential(1.0, 12).tolist())
    narrow = mean_interval(rng.exponential(1.0, 400).tolist())
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 3
    assert mean_interval([1.0]) is None and mean_interval([1.0, float("nan")]) is None
    assert mean_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_requests_to_resolve():
    rng = np.random.default_rng(5)
    a, b = paired_sample(rng, 200, 0.9)
    n = requests_to_resolve(a, b, difference=0.10)
    r = a.mean() / b.mean()
    sd = np.std(a - r * b, ddof=1)
    assert n == math.ceil(((1.96 + 0.84) * sd / (0.1 * b.mean())) ** 2)
    assert requests_to_resolve(a, b, difference=0.2) < n
    with pytest.raises(ValueError):
        requests_to_resolve([1.0], [1.0])


def _record(system: str, ttfts, rate: float = 1.0, reused: int = 0) -> RunRecord:
    samples = [RequestSample(ttft_s=t, e2e_s=t + 0.1, queue_s=0.0, itl_s=(0.05, 0.05), prompt_tokens=100,
                             computed_tokens=100 - reused, reused_by_tier={"device": 0, "dram": reused, "ssd": 0},
                             output_tokens=3, key=(0, i), output_hash=f"h{i}") for i, t in enumerate(ttfts)]
    return RunRecord(system, rate, samples, duration_s=10.0)


def test_targets_are_judged_on_the_interval():
    rng = np.random.default_rng(6)
    b = rng.lognormal(0.0, 0.8, size=12)
    a = b * rng.gamma(2.0, 0.5, size=12)
    a *= 0.4 * b.sum() / a.sum()  # point ratio exactly 0.4; with 12 noisy requests the interval is wide
    report = build_report([_record("pcr", a), _record("no-reuse", b)], kind="bench",
                          targets=[RatioTarget("t", "pcr", "no-reuse", "ttft.mean", max_ratio=0.45),
                                   RatioTarget("easy", "pcr", "no-reuse", "ttft.mean", max_ratio=5.0)])
    res = {r.name: r for r in evaluate_targets(report, [
        RatioTarget("t", "pcr", "no-reuse", "ttft.mean", max_ratio=0.45),
        RatioTarget("easy", "pcr", "no-reuse", "ttft.mean", max_ratio=5.0),
        RatioTarget("higher", "pcr", "no-reuse", "reuse_ratio", min_ratio=1.5)])}
    t = res["t"]
    assert t.ratio == pytest.approx(0.4) and t.ci_high > 0.45 and not t.passed  # the point meets it, the upper end does not
    assert res["easy"].passed and res["easy"].ci_high <= 5.0
    assert res["higher"].ratio is None or not res["higher"].passed  # no reuse at all: 0/0
    md = markdown_report(report)
    assert "95% CI" in md and "judged at the upper end" in md and "## Ratios with 95% bootstrap intervals" in md


def test_min_ratio_target_judged_at_the_lower_end_and_flags_not_significant():
    runs = [_record("pcr@cache-aware", [1.0] * 20, reused=60), _record("pcr", [1.0] * 20, reused=30)]
    report = build_report(runs, kind="bench", aliases={"pcr@relevance": "pcr"})
    (res,) = evaluate_targets(report, [RatioTarget("gain", "pcr@cache-aware", "pcr@relevance", "reuse_ratio",
                                                   min_ratio=1.5)])
    assert res.ratio == pytest.approx(2.0) and res.ci_low == pytest.approx(2.0) and res.passed
    assert math.isinf(res.max_ratio)
    # equal TTFTs: the mean-TTFT ratio is 1 and not significant
    row = next(r for r in report["ratios"] if r["system"] == "pcr" and r["stat"] == "ttft.mean")
    assert row["ratio"] == pytest.approx(1.0) and row["significant"] is False
    assert "no (n.s.)" in markdown_report(report)
    # answers: same hashes -> all equal; the alias resolves
    assert any(a["system"] == "pcr@cache-aware" and a["equal"] == 20 for a in report["answers"])
