"""`python -m pcr_rag.bench.remote`'s ratios: per rate slot, from the new-replica systems only (a report's saturation
runs have other systems and an infinite rate). `run_bench` is replaced by a canned report (a unit test)."""

from __future__ import annotations

import pytest

from pcr_rag.bench import remote


def _run(system: str, rate, ttft: float) -> dict:
    extra = {"remote_io": {"hits": 3, "errors": 0}} if system.startswith("pcr-remote") else {}
    return {"system": system, "rate": rate, "ttft": {"mean": ttft}, "hit_ratio": {"dram": 0.5}, "extra": extra}


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
