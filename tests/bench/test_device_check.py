"""The GPU check's measurements run end to end on the CPU with the tiny model (the figures themselves are only
meaningful on a GPU: scripts/gpu_check.sh)."""

from __future__ import annotations

import json

import pytest

from pcr_rag.bench.device_check import format_report, main, run_device_check


def test_every_part_measures_and_reports(tmp_path):
    checkpoints: list[set[str]] = []
    report = run_device_check(config="tiny", device="cpu", batches=(1, 4), context=48, steps=2, reps=1,
                              prefill_tokens=64, prefix_tokens=300, limit_reps=1, copy_bytes=1 << 20,
                              checkpoint=lambda r: checkpoints.append(set(r)))
    assert report["memory"]["copy_gb_s"] > 0 and "h2d_pinned_gb_s" not in report["memory"]  # CPU: no host copy
    rows = {(r["impl"], r["batch"]): r for r in report["decode"]}
    assert set(rows) == {("fast", 1), ("fixed", 1), ("fixed", 4), ("transformers", 1)}
    assert rows[("fixed", 1)]["gemm_rows"] == 4 and rows[("fast", 1)]["gemm_rows"] <= 4
    assert all(r["ms_per_step"] > 0 and r["vs_roofline"] > 0 for r in report["decode"])
    assert [r["impl"] for r in report["prefill"]] == ["transformers", "fast"]
    assert report["profile"]["suffix_fast_s"] > 0 and "aten::" in report["profile"]["profile_decode_8_active_rows_cpu"]
    assert report["engine"]["prompt_tokens"] > 300 and report["engine"]["engine_over_forward"] > 0
    assert "aten::" in report["engine"]["profile_engine_cold_cpu"], "the executor thread's ops are recorded"
    assert report["overlap"]["ttft_dram_s"] > 0 and report["overlap"]["prefix_tokens"] > 0
    assert checkpoints[-1] == set(report) and len(checkpoints) == 6  # one per part
    text = format_report(report)
    assert "decode (roofline" in text and "overlap: prefix" in text and "engine: a cold" in text


def test_cli_writes_json_of_the_parts_asked_for(tmp_path, capsys):
    out = tmp_path / "device.json"
    assert main(["--config", "tiny", "--device", "cpu", "--parts", "memory,prefill", "--reps", "1",
                 "--prefill-tokens", "32", "--copy-bytes", str(1 << 20), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "prefill" in report and "decode" not in report and "overlap" not in report
    assert "prefill fast" in capsys.readouterr().out


def test_an_unknown_part_is_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown parts \\['decoed'\\]"):
        run_device_check(config="tiny", device="cpu", parts=("memory", "decoed"))


def test_pinned_allocation_cost_is_measured_fresh_and_cached(monkeypatch):
    """On a GPU host every new chunk's DRAM payload is a page-locked allocation; the check times it fresh (new
    locked memory) and from the host allocator's cache. No CUDA here: the allocation is stood in for by a plain one,
    and the report line is checked on a synthetic report."""
    import torch

    from pcr_rag.bench.device_check import pinned_alloc_ms

    real_empty = torch.empty
    calls: list[bool] = []

    def empty(*size, pin_memory=False, **kw):
        calls.append(pin_memory)
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    got = pinned_alloc_ms(chunk_bytes=1 << 20, count=3)
    assert calls == [True] * 6 and got["fresh_ms"] > 0 and got["cached_ms"] > 0 and got["chunk_bytes"] == 1 << 20
    report = {"config": "tiny", "parameters": 1e6, "dtype": "bf16", "device": "GPU", "torch": "x",
              "memory": {"copy_gb_s": 1000.0, "copy_bytes": 1, "h2d_pinned_gb_s": 50.0, "d2h_pinned_gb_s": 50.0,
                         "pinned_alloc": {"chunk_bytes": 32 << 20, "fresh_ms": 9.5, "cached_ms": 0.01}}}
    assert "page-locked 32 MiB buffer (a new chunk's DRAM payload): 9.50 ms fresh" in format_report(report)
