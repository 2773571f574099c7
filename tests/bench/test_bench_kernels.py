"""`pcr-rag bench kernels` end to end on a tiny model, its report checks, and the perplexity emulation."""

from __future__ import annotations

import copy
import json
import math
import tempfile

import pytest
import torch

from pcr_rag.bench.kernels import KernelBenchConfig, check_report, format_report, run_kernel_bench
from pcr_rag.bench.perplexity import dequantized_weight, emulated_model, measure
from pcr_rag.cli import main
from pcr_rag.model.weights import WEIGHT_FORMATS, make_linear
from pcr_rag.testing import save_tiny_model, tiny_loaded_model


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """The CLI run once: ``pcr-rag bench kernels --quick`` on a tiny Llama saved as a local model directory."""
    root = tmp_path_factory.mktemp("kernels")
    model_dir = save_tiny_model(root / "tiny-llama", "llama")
    out = root / "kernels.json"
    rc = main(["bench", "kernels", "--quick", "--model", str(model_dir), "--json", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


def test_quick_cli_writes_the_schema_outside_tools_read(quick_report):
    check_report(quick_report)  # keys, types, finite positive figures
    assert {"roofline_ms", "bandwidth_gb_s", "decode", "prefill", "perplexity", "peer", "profile"} <= set(quick_report)
    assert quick_report["peer"] is None and quick_report["peer_skipped"]  # no GGUF behind a tiny model
    cfg = quick_report["config"]
    decode = {(r["weights"], r["batch"], r["impl"]) for r in quick_report["decode"]}
    assert decode == ({(f, b, "fast") for f in WEIGHT_FORMATS for b in cfg["decode_batches"]}
                      | {("bf16", 1, "transformers"), ("bf16", 1, "fast-fixed")})
    for r in quick_report["decode"]:  # fewer active rows never run more GEMM rows than the batch, nor fewer than active
        assert r["batch"] <= r["gemm_rows"] <= cfg["batch_rows"] or r["impl"] == "transformers"
    assert next(r for r in quick_report["decode"] if r["impl"] == "fast-fixed")["gemm_rows"] == cfg["batch_rows"]
    chunks = [r["chunk_size"] for r in quick_report["prefill"] if r["weights"] == "bf16"]
    assert chunks == [None, *cfg["chunk_sizes"], cfg["prompt_tokens"]]
    assert all(r["tokens"] == cfg["prompt_tokens"] for r in quick_report["prefill"])
    one_shot = quick_report["prefill"][0]
    assert one_shot["impl"] == "transformers" and one_shot["vs_one_shot"] == 1.0


def test_quick_figures_are_consistent(quick_report):
    for r in quick_report["decode"]:
        assert math.isclose(r["tokens_per_s"], r["batch"] * 1e3 / r["ms_per_step"])
    roofline = quick_report["memory"]["roofline_ms_by_weights"]
    assert roofline["bf16"] == quick_report["roofline_ms"]
    ran_as = {r["weights"]: r["ran_as"] for r in quick_report["decode"]}
    for fmt in ("int8", "int4"):  # fewer weight bytes per step, unless the format fell back to dense weights
        assert roofline[fmt] < roofline["bf16"] if ran_as[fmt] == fmt else roofline[fmt] == roofline["bf16"]
    if ran_as["int8"] == "int8" and ran_as["int4"] == "int4":
        assert roofline["int4"] < roofline["int8"]
    for r in quick_report["prefill"]:
        if r["impl"] == "fast":  # the forward is split-invariant in every format: the last logits are bit-equal
            assert r["split_invariant"] is True, r
            assert r["max_abs_diff_vs_one_step"] == 0.0
    ppl = quick_report["perplexity"]["by_weights"]
    assert ppl["bf16"]["vs_bf16"] == 1.0 and ppl["bf16"]["fast_last_logits_max_abs_diff"] >= 0.0
    assert all(math.isfinite(v["perplexity"]) and v["perplexity"] > 1.0 for v in ppl.values())
    for name in ("decode", "prefill"):
        prof = quick_report["profile"][name]
        assert prof["top_ops"] and all(o["self_cpu_ms"] >= 0 for o in prof["top_ops"])
    assert set(quick_report["targets"]) >= {"decode_bf16_b1_vs_roofline", "prefill_default_plan_vs_one_shot",
                                            "decode_fixed_shapes_vs_free"}
    text = format_report(quick_report)
    assert "null (one shot)" in text and "vs_roofline" in text and "fixed_over_free" in text


def test_quick_invariance_section_pairs_fixed_shapes_with_exact_row_counts(quick_report):
    """What fixed shapes cost: per active-row count, the engine's step (padded to a proven-exact row count) and a
    forward that runs exactly those rows, paired; the batch's own row count is the noise floor (the same forward)."""
    inv = quick_report["invariance"]
    cfg = quick_report["config"]
    assert [r["active_rows"] for r in inv["rows"]] == list(cfg["invariance_rows"]) == [3, 8]
    for r in inv["rows"]:
        assert r["free_gemm_rows"] == r["active_rows"] <= r["fixed_gemm_rows"] <= cfg["batch_rows"]
        assert r["tries"] == cfg["decode_reps"] and r["fixed_over_free"] > 0
    assert inv["rows"][-1]["fixed_gemm_rows"] == 8
    ratios = [r["fixed_over_free"] for r in inv["rows"]]
    assert math.isclose(inv["max_fixed_over_free"], max(ratios))
    assert min(ratios) <= inv["geomean_fixed_over_free"] <= max(ratios)
    assert quick_report["targets"]["decode_fixed_shapes_vs_free"]["value"] == inv["geomean_fixed_over_free"]


def test_check_report_rejects_broken_figures(quick_report):
    bad = copy.deepcopy(quick_report)
    bad["decode"][0]["ms_per_step"] = float("nan")
    with pytest.raises(ValueError, match="finite positive"):
        check_report(bad)
    bad = copy.deepcopy(quick_report)
    bad["prefill"] = [r for r in bad["prefill"] if r["chunk_size"] is not None]
    with pytest.raises(ValueError, match="one-shot row"):
        check_report(bad)


def test_bad_arguments_exit_2_before_any_compute(capsys):
    assert main(["bench", "kernels", "--quick", "--batches", "1,9", "--no-progress"]) == 2
    assert "decode_batches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "kernels", "--weights", "fp8"])


def test_config_validation():
    KernelBenchConfig().validate()
    KernelBenchConfig.quick().validate()
    with pytest.raises(ValueError, match="bf16"):
        KernelBenchConfig(weight_formats=("int8",)).validate()
    with pytest.raises(ValueError, match="ppl_tokens"):
        KernelBenchConfig(ppl_tokens=1).validate()
    assert KernelBenchConfig().default_plan == 256
    assert KernelBenchConfig.quick().default_plan == 64  # 256 not measured: the largest chunk size
    assert KernelBenchConfig().active_row_counts == tuple(range(1, 9))  # every count of active rows of 8
    with pytest.raises(ValueError, match="invariance_rows"):
        KernelBenchConfig(invariance_rows=(0, 9)).validate()


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_dequantized_weight_is_what_the_kernel_computes_with(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    lin = make_linear(fmt, w)
    w_hat = dequantized_weight(lin, torch.bfloat16)
    assert w_hat.shape == w.shape
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    # a dense GEMM over the recovered weight reproduces the kernel up to bf16 rounding of the products' sum
    assert torch.allclose(torch.nn.functional.linear(x, w_hat).float(), lin(x).float(), atol=0.1, rtol=0.02)
    if fmt == "bf16":
        assert torch.equal(w_hat, w)
    else:  # quantization changed the weights, by less than a quantization step
        step = (w.float().abs().amax() / 127) if fmt == "int8" else (w.float().amax() - w.float().amin()) / 15
        assert not torch.equal(w_hat, w) and (w_hat.float() - w.float()).abs().max() <= step


def test_emulated_model_leaves_the_model_alone_and_measures():
    loaded = tiny_loaded_model("llama", dtype=torch.bfloat16)
    model = loaded.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert emulated_model(model, "bf16") is model
    clone = emulated_model(model, "int4")
    assert clone is not model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(clone.lm_head.weight, model.lm_head.weight)
    assert torch.equal(clone.model.embed_tokens.weight, model.model.embed_tokens.weight)
    passages = [list(range(5, 40)), list(range(40, 70))]
    res = measure(model, passages, "int4")
    assert res.tokens == 34 + 29 and res.perplexity > 1.0 and res.fast_last_logits_max_abs_diff is None
    assert math.isclose(res.perplexity, math.exp(res.nll_per_token))
    with pytest.raises(ValueError, match=">= 2 tokens"):
        measure(model, [[5]], "bf16")


@pytest.mark.slow
def test_quick_on_the_real_model_is_split_invariant():
    cfg = KernelBenchConfig.quick(peer=False, chunk_sizes=(64,), prefill_formats=("bf16",),
                                  weight_formats=("bf16", "int8"), decode_batches=(1, 8), ppl_passages=1)
    report = run_kernel_bench(cfg, progress=False)
    check_report(report)
    assert all(r["split_invariant"] for r in report["prefill"] if r["impl"] == "fast")
    ppl = report["perplexity"]["by_weights"]
    assert ppl["bf16"]["perplexity"] < 100  # a trained model on English docs, not noise
    assert ppl["int8"]["vs_bf16"] < 1.05


def test_miss_cost_runs_a_trace_that_reuses_nothing(tmp_path, monkeypatch):
    from pcr_rag.bench.limit import measure_miss_cost, miss_trace

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its own work directory goes (no workdir)
    loaded = tiny_loaded_model("llama", dtype=torch.float32)
    trace = miss_trace(loaded.tokenizer, 5, prompt_tokens=150)
    docs = [d for _, ds in trace for d in ds]
    assert len(docs) == 10 and len(set(docs)) == 10  # every document distinct
    res = measure_miss_cost(loaded.model, loaded.tokenizer, requests=2, passes=2, prompt_tokens=150,
                            dtype=torch.float32, progress=False)
    assert not list(tmp_path.glob("pcr-miss-*")), "its own cache directories are removed"
    assert res.requests == 2 and res.passes == 2 and len(res.ratios) == 4
    assert all(math.isfinite(r) and r > 0 for r in res.ratios)
    assert res.ratio_median > 0 and res.ttft_on_s > 0 and res.ttft_off_s > 0
    # nothing but the chat preamble that every prompt starts with is reused
    assert res.reused_tokens_total / 4 < res.prompt_tokens_mean / 3 and res.computed_tokens_mean > 100
    assert "target <= 1.05" in res.summary()


def test_llamacpp_peer_worker_failures_are_peer_errors(tmp_path):
    from pcr_rag.bench.llamacpp_peer import LlamaCppPeer, PeerError, find_gguf

    assert find_gguf(str(tmp_path)) is None  # a directory that is no alias and no .gguf
    bogus = tmp_path / "missing.gguf"
    bogus.write_bytes(b"not a gguf")
    assert find_gguf(str(bogus)) == bogus
    # whatever fails in the worker (llama_cpp missing, a bad file, a crash) surfaces as PeerError, never a hang
    with pytest.raises(PeerError):
        LlamaCppPeer(bogus, threads=1, n_ctx=16, timeout_s=120)


def test_limit_ratio_times_no_engine_on_its_first_call(tmp_path, monkeypatch):
    """Every engine the limit ratio times has served the same prompt once, untimed (on a GPU a first call pays
    one-time set-up per shape: counting it made the cold TTFT read 5x the forward)."""
    from pcr_rag.bench.limit import measure_limit_ratio
    from pcr_rag.engine import PCREngine

    loaded = tiny_loaded_model("llama", dtype=torch.float32)
    calls: dict[int, int] = {}
    timed_first: list[bool] = []
    real_generate = PCREngine.generate

    def generate(self, *args, **kwargs):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if not self.config.enable_cache:
            timed_first.append(calls[id(self)] == 1)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(PCREngine, "generate", generate)
    docs = ["alpha beta gamma delta " * 20, "epsilon zeta eta theta " * 20]
    res = measure_limit_ratio(loaded.model, loaded.tokenizer, documents=docs, reps=2, chunk_size=16,
                              workdir=tmp_path, dtype=torch.float32)
    assert res.ttft_uncached_s > 0 and res.reps == 2
    assert timed_first == [True, False, False], "the cache-off engine is warmed once, then timed reps times"
