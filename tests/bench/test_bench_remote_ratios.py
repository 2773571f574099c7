"""`python -m pcr_rag.bench.remote`'s ratios: per rate slot, from the new-replica systems only (a report's saturation
runs have other systems and an infinite rate). `run_bench` is replaced by a canned report (a unit test)."""

from __future__ import annotations

import pytest

from pcr_rag.bench import remote


def _run(system: str, rate, ttft: float) -> dict:
    """A run of 12 requests (2 repeats x 6, the same keys in every system) whose TTFTs average ``ttft``."""
    extra = {"remote_io": {"hits": 3, "errors": 0}} if system.startswith("pcr-remote") else {}
    spread = [0.5, 0.8, 1.0, 1.0, 1.2, 1.5] * 2  # mean 1.0
    requests = {"key": [[i // 6, i % 6] for i in range(12)], "ttft": [ttft * x for x in spread]}
    return {"system": system, "rate": rate, "ttft": {"mean": ttft}, "hit_ratio": {"dram": 0.5}, "extra": extra,
            "requests": requests}


def test_ratios_per_rate_ignore_saturation_runs(monkeypatch, tmp_path):
    seen = {}

    def fake_run_bench(cfg, progress=False):
        seen["cfg"] = cfg
        runs = [_run(s, r, t * (1 + i)) for i, r in enumerate((0.3, 0.5))
                for s, t in (("no-reuse", 1.0), ("pcr", 0.25), ("pcr-cold", 0.5), ("pcr-remote", 0.2),
                             ("pcr-remote-down", 0.55))]
        runs += [_run("pcr-max-active-1", "inf", 3.0), _run("pcr-max-active-8", "inf", 1.0)]
        return {"runs": runs, "notes": [], "rate_loads": None}

    monkeypatch.setattr(remote, "run_bench", fake_run_bench)
    out = remote.bench_ratios("redis://127.0.0.1:1/0", model=None, repeats=1, work=tmp_path)
    assert seen["cfg"].saturation == () and seen["cfg"].extra["remote_url"] == "redis://127.0.0.1:1/0"
    assert set(out["ratios_by_rate"]) == {"0.3", "0.5"} and out["target_rate"] == "0.3"
    assert out["ratios"]["ttft_remote_over_off"] == pytest.approx(0.4)
    assert out["ratios"]["ttft_down_over_off"] == pytest.approx(1.1)
    # the warm local replica is the bound a remote tier is judged against
    assert "pcr" in seen["cfg"].systems
    assert out["ratios"]["ttft_local_over_off"] == pytest.approx(0.5)
    assert out["ratios"]["ttft_remote_over_local"] == pytest.approx(0.8)
    assert {rate: set(io) for rate, io in out["remote_io_by_rate"].items()} == {
        "0.3": {"pcr-remote", "pcr-remote-down"}, "0.5": {"pcr-remote", "pcr-remote-down"}}
    # every ratio carries its paired bootstrap interval; here every request scales alike, so it is the point itself
    ci = out["intervals"]["ttft_remote_over_off"]
    assert ci["n"] == 12 and ci["low"] == pytest.approx(0.4) and ci["high"] == pytest.approx(0.4)
    assert set(out["intervals_by_rate"]["0.5"]) == set(out["ratios_by_rate"]["0.5"])
    # judged as the bench judges its targets, at the interval's upper end, and only the bounded ratios (the warm
    # local replica is a reference, not a target)
    bounds = {"ttft_remote_over_off": 0.4, "ttft_down_over_off": 1.1}
    assert out["ttft_targets_met"] == {n: out["intervals"][n]["high"] <= b for n, b in bounds.items()}


def test_a_ttft_target_is_missed_when_the_interval_upper_end_crosses_it(monkeypatch, tmp_path):
    """Point 0.38 (under 0.4), but the requests disagree: the interval's upper end is above 0.4, so not met."""
    def fake_run_bench(cfg, progress=False):
        runs = [_run(s, 0.3, t) for s, t in (("no-reuse", 1.0), ("pcr", 0.25), ("pcr-cold", 1.0),
                                              ("pcr-remote-down", 1.0))]
        remote_run = _run("pcr-remote", 0.3, 0.38)
        remote_run["requests"]["ttft"] = [0.05, 0.9, 0.2, 0.7, 0.3, 0.1] * 2  # mean 0.375, ratio ~0.38
        return {"runs": runs + [remote_run], "notes": [], "rate_loads": None}

    monkeypatch.setattr(remote, "run_bench", fake_run_bench)
    out = remote.bench_ratios("redis://127.0.0.1:1/0", model=None, repeats=1, work=tmp_path)
    ci = out["intervals"]["ttft_remote_over_off"]
    assert ci["ratio"] < 0.4 < ci["high"]
    assert out["ttft_targets_met"]["ttft_remote_over_off"] is False


def test_the_underlying_bench_report_is_written_when_asked(monkeypatch, tmp_path):
    report = {"runs": [_run(s, 0.3, t) for s, t in (("no-reuse", 1.0), ("pcr", 0.25), ("pcr-cold", 1.0),
                                                      ("pcr-remote", 0.4), ("pcr-remote-down", 1.0))],
              "notes": [], "rate_loads": None}
    written = {}
    monkeypatch.setattr(remote, "run_bench", lambda cfg, progress=False: report)
    monkeypatch.setattr(remote, "write_report", lambda rep, **paths: written.update(paths, report=rep))
    remote.bench_ratios("redis://127.0.0.1:1/0", model=None, repeats=1, work=tmp_path)
    assert written == {}  # not asked
    remote.bench_ratios("redis://127.0.0.1:1/0", model=None, repeats=1, work=tmp_path,
                        report_path=tmp_path / "remote-report.json")
    assert written["report"] is report and written["json_path"] == tmp_path / "remote-report.json"
    assert written["markdown_path"] == tmp_path / "remote-report.md"
