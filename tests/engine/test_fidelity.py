"""Fidelity: reuse never changes the answer. Cached runs equal uncached runs bit for bit, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOCS = {
    "d1": "The Rhine flows from the Swiss Alps to the North Sea through Germany and the Netherlands. " * 4,
    "d2": "Photosynthesis converts light energy into chemical energy stored in glucose molecules. " * 5,
    "d3": "A binary search halves the candidate interval at every step until the key is found. " * 3,
}
REQUESTS = [  # the orders and overlaps
    (("d1", "d2"), "Where does the Rhine end?"),
    (("d1", "d3"), "How does binary search work?"),
    (("d2", "d3"), "What does photosynthesis store?"),
    (("d1", "d2"), "Which countries does the river cross?"),
]


def _engine(model, tok, tmp_path, name, **kw) -> PCREngine:
    cfg = dict(cache_dir=tmp_path / name, chunk_size=16, dram_capacity="64MiB", ssd_capacity="256MiB",
               max_new_tokens=8, device=TEST_DEVICE,
               load_planner="always-load")  # the SSD path itself: on a tiny model recomputing beats reading, which the planner would choose
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def _run_all(engine: PCREngine, requests=REQUESTS):
    out = []
    for docs, q in requests:
        r = engine.generate(q, [DOCS[d] for d in docs])
        out.append(r)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_equals_uncached_bitwise(arch, dtype, tmp_path):
    model, tok = tiny_model(arch, dtype=dtype)
    with _engine(model, tok, tmp_path, "off", enable_cache=False, dtype=dtype) as off:
        ref = _run_all(off)
    with _engine(model, tok, tmp_path, "on", dtype=dtype) as on:
        got = _run_all(on)
        again = _run_all(on)  # everything cached now
    for a, b, c in zip(ref, got, again):
        assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)
        assert torch.equal(a.first_token_logits, c.first_token_logits)
    assert got[3].metrics.reused_tokens > 0, "[d1,d2,q4] must reuse [d1,d2] from [d1,d2,q1]"
    assert all(r.metrics.reused_tokens > 0 for r in again)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_fp32_matches_transformers_generate(arch, tmp_path):
    model, tok = tiny_model(arch, dtype=torch.float32)
    with _engine(model, tok, tmp_path, "on") as eng:
        _run_all(eng)
        results = _run_all(eng)
    device = next(model.parameters()).device  # where the engine put the model (TEST_DEVICE)
    for r in results:
        ids = torch.tensor([r.prompt_token_ids], device=device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, -1]
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(r.token_ids) or 1,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        assert torch.allclose(logits.cpu(), r.first_token_logits.cpu(), atol=1e-4, rtol=0)
        expected = gen[0, ids.shape[1]:].tolist()
        assert r.token_ids == expected[: len(r.token_ids)]


def test_chunk_size_256_and_partial_chunks(tmp_path):
    model, tok = tiny_model("llama", dtype=torch.float32)
    long_doc = DOCS["d1"] * 8  # several full 256-token chunks plus a partial tail
    reqs = [((long_doc, DOCS["d2"]), "q one"), ((long_doc, DOCS["d3"]), "q two")]
    outs = {}
    for enable in (False, True):
        with _engine(model, tok, tmp_path, f"c{enable}", chunk_size=256, enable_cache=enable) as eng:
            outs[enable] = [eng.generate(q, list(d)) for d, q in reqs] + [eng.generate(q, list(d)) for d, q in reqs]
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)
    assert outs[True][1].metrics.reused_tokens >= 256
    assert outs[True][2].metrics.reused_tokens > outs[True][1].metrics.reused_tokens


def test_dram_ssd_dram_round_trip_and_restart(tmp_path):
    """Chunks demoted to SSD (tiny DRAM), read back, and reused after an engine restart: still exact."""
    model, tok = tiny_model("llama", dtype=torch.float32)
    with _engine(model, tok, tmp_path, "ref", enable_cache=False) as off:
        ref = _run_all(off)
    kw = dict(dram_capacity=64 * 1024)  # a few chunks: most go DRAM -> SSD
    with _engine(model, tok, tmp_path, "rt", **kw) as eng:
        first = _run_all(eng)
        eng.flush()
        second = _run_all(eng)
        stats = eng.stats().as_dict()
    assert stats["requests"]["reused_by_tier"]["ssd"] > 0, "expected SSD hits with a 64 KiB DRAM tier"
    with _engine(model, tok, tmp_path, "rt", **kw) as eng2:  # restart on the same cache_dir
        third = _run_all(eng2)
    assert third[0].metrics.reused_tokens > 0, "a restarted engine reuses yesterday's cache"
    for a, b, c, d in zip(ref, first, second, third):
        assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
        assert torch.equal(a.first_token_logits, d.first_token_logits)
        assert torch.equal(a.first_token_logits, c.first_token_logits)


@pytest.mark.parametrize("chunk_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_cached_equals_uncached_equals_other_splits(arch, dtype, chunk_size, tmp_path):
    """Cached == uncached == prefilled in other step sizes, bit for bit, with partial chunks (each document is
    chunked on its own, so its last chunk is partial) and Gemma 3's sliding windows."""
    model, tok = tiny_model(arch, dtype=dtype)
    long = [(("d1", "d2", "d3"), "q a"), (("d1", "d2"), "q b"), (("d1", "d2", "d3"), "q c")]
    reqs = [tuple(DOCS[d] * 3 for d in docs) for docs, _ in long]
    outs = []
    # step sizes: one shot, chunk-sized, and two that align with nothing: 23 is coprime to every chunk size, tile
    # and attention block, so its ~110 steps per request end at nearly every offset within them
    for enable, step in ((False, 4096), (True, 16), (True, 100), (False, 23)):
        with _engine(model, tok, tmp_path, f"s{enable}{step}", chunk_size=chunk_size, enable_cache=enable,
                     dtype=dtype, prefill_chunk_tokens=step) as eng:
            runs = [eng.generate(q, list(d)) for d, (_, q) in zip(reqs, long)]
            # a second pass replays from the cache; without a cache it would only repeat the first
            outs.append(runs + ([eng.generate(q, list(d)) for d, (_, q) in zip(reqs, long)] if enable else runs))
    assert outs[1][1].metrics.reused_tokens > 0 and outs[1][3].metrics.reused_tokens > 0
    assert any(c.partial for c in _plan_of(tok, model, tmp_path, chunk_size, reqs[0], long[0][1]))
    for runs in outs[1:]:
        for a, b in zip(outs[0], runs):
            assert a.token_ids == b.token_ids
            assert torch.equal(a.first_token_logits, b.first_token_logits)


def _plan_of(tok, model, tmp_path, chunk_size, docs, q):
    with _engine(model, tok, tmp_path, "plan", chunk_size=chunk_size, enable_cache=False) as eng:
        return eng.plan_for(q, list(docs))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_cached_equals_uncached(weights, tmp_path):
    model, tok = tiny_model("llama", dtype=torch.bfloat16)
    with _engine(model, tok, tmp_path, "off", enable_cache=False, dtype=torch.bfloat16, weights=weights) as off:
        ref = _run_all(off)
        assert weights in off.forward.plan_id
    with _engine(model, tok, tmp_path, "on", dtype=torch.bfloat16, weights=weights) as on:
        got = _run_all(on) + _run_all(on)
        assert got[-1].metrics.reused_tokens > 0
        root = on.root_key
    with _engine(model, tok, tmp_path, "dense", dtype=torch.bfloat16) as dense:
        assert dense.root_key != root, "KV never crosses weight formats"
    for a, b in zip(ref + ref, got):
        assert a.token_ids == b.token_ids and torch.equal(a.first_token_logits, b.first_token_logits)


def test_missing_quantized_kernel_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    from pcr_rag.model import weights as weights_mod

    def broken(*_a, **_k):
        raise RuntimeError("no int8 kernel in this build")

    monkeypatch.setattr(weights_mod.torch, "_weight_int8pack_mm", broken)
    model, tok = tiny_model("llama", dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="pcr_rag.model.weights"), \
            _engine(model, tok, tmp_path, "fb", dtype=torch.bfloat16, weights="int8") as eng:
        assert eng.forward.weights == "bf16"
        eng.generate("q", [DOCS["d1"]])
    warnings = [r for r in caplog.records if "int8" in r.getMessage()]
    assert len(warnings) == 1 and "no int8 kernel" in warnings[0].getMessage()
