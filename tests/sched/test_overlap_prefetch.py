"""Layer-wise overlap, queue-based prefetch and announcements on tiny models."""

from __future__ import annotations

import time

import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOC_A = "Kafka stores ordered records in partitions that consumers read at their own pace. " * 6
DOC_B = "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 6
DOC_C = "Bloom filters answer membership queries with false positives but never false negatives. " * 6


def _engine(model, tok, path, storage=None, **kw) -> PCREngine:
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="64MiB", ssd_capacity="256MiB", max_new_tokens=4,
               device=TEST_DEVICE, load_planner="always-load")  # the SSD path itself: on a tiny model recomputing beats reading, which the planner would choose
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg), storage=storage)


def _wait_until(cond, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_reuse_counts_matched_full_chunks(tmp_path):
    model, tok = tiny_model("llama", num_layers=4)
    with _engine(model, tok, tmp_path / "c") as eng:
        r1 = eng.generate("first question?", [DOC_A, DOC_B])
        r2 = eng.generate("second question?", [DOC_A, DOC_B])
        plan = eng.plan_for("second question?", [DOC_A, DOC_B])
    with _engine(model, tok, tmp_path / "ref", enable_cache=False) as ref:
        r2_ref = ref.generate("second question?", [DOC_A, DOC_B])
    assert r1.metrics.reused_tokens == 0
    shared = [c for c in plan if c.segment <= 2]  # [prefix][doc A][sep + doc B]
    assert r2.metrics.reused_tokens >= sum(c.num_tokens for c in shared if not c.partial)
    assert r2.metrics.computed_tokens + r2.metrics.reused_tokens == r2.metrics.prompt_tokens
    assert r2.metrics.reused_by_tier["dram"] == r2.metrics.reused_tokens
    assert r2.token_ids == r2_ref.token_ids


def test_layerwise_prefill_starts_before_last_layer_loaded(tmp_path):
    """With a slow SSD, layer 0 computes while later layers are still loading, and the answer is exact."""
    from pcr_rag.cache.storage import LocalDirBackend, SlowBackend

    model, tok = tiny_model("llama", num_layers=4)
    path = tmp_path / "slow"
    with _engine(model, tok, path) as warm:
        ref = warm.generate("what is kafka?", [DOC_A, DOC_B])
        warm.flush()  # on SSD now; the restarted engine below starts with an empty DRAM tier
    slow = SlowBackend(LocalDirBackend(path), latency_s=0.004)
    with _engine(model, tok, path, dram_capacity=0, prefetch=False, storage=slow) as eng:
        r = eng.generate("what is kafka?", [DOC_A, DOC_B])
        load = eng.copy_engine.last_load
    assert r.metrics.reused_by_tier["ssd"] > 0
    assert r.token_ids == ref.token_ids
    assert torch.equal(r.first_token_logits, ref.first_token_logits)
    assert load is not None and load.first_wait_done_at is not None
    assert load.first_wait_done_at < load.ready_at[-1], "prefill must start before the last layer is loaded"


def test_announced_request_finds_its_chunks_prefetched(tmp_path):
    model, tok = tiny_model("llama", num_layers=2)
    path = tmp_path / "pf"
    with _engine(model, tok, path) as eng:
        eng.generate("warm a", [DOC_A, DOC_B])
        eng.flush()
    with _engine(model, tok, path) as eng:  # restart: DRAM empty, chunks on SSD only
        ticket = eng.announce([DOC_A, DOC_B])
        assert ticket.keys and any(ticket.keys[0] == keys[0] for keys in eng.window_snapshot())
        n_doc_chunks = len(ticket.keys)

        def prefetched() -> bool:
            m = eng.cache.match(ticket.keys)
            return m.num_chunks == n_doc_chunks and all(t.value == "dram" for t in m.tiers)

        assert _wait_until(prefetched), "the announced request's chunks should be loaded SSD -> DRAM"
        r = eng.generate("warm b", [DOC_A, DOC_B])
        st = eng.stats().as_dict()
    assert r.metrics.announced
    assert r.metrics.prefetch_hit_chunks > 0
    assert r.metrics.reused_by_tier["dram"] > 0 and r.metrics.reused_by_tier["ssd"] == 0
    assert st["prefetch"]["claimed"] == 1


def test_corrupt_ssd_chunk_is_recomputed_transparently(tmp_path):
    model, tok = tiny_model("llama", num_layers=2)
    path = tmp_path / "corrupt"
    with _engine(model, tok, path) as eng:
        ref = eng.generate("kafka?", [DOC_A, DOC_B])
        eng.flush()
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files, "chunks should have been written to the SSD tier"
    for f in files:  # flip a byte in the middle of every chunk file's payload
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    with _engine(model, tok, path, prefetch=False) as eng:
        r = eng.generate("kafka?", [DOC_A, DOC_B])
        dropped = eng.cache.stats().corrupt_chunks_dropped
    assert r.token_ids == ref.token_ids
    assert torch.equal(r.first_token_logits, ref.first_token_logits)
    assert dropped > 0
    assert r.metrics.reused_tokens < ref.metrics.prompt_tokens


def test_corrupt_chunk_found_while_a_step_is_paused_between_layers(tmp_path):
    """Under the ITL budget a hit's step runs one layer per engine step next to a decoding row; a corrupt chunk
    found at a later layer restarts the prefill before it, and the answer is still exact."""
    from pcr_rag.request import RagPrompt, SamplingParams

    model, tok = tiny_model("llama", num_layers=4)
    path = tmp_path / "paused"
    with _engine(model, tok, path) as eng:
        ref = eng.generate("kafka?", [DOC_A, DOC_B])
        eng.flush()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.stat().st_size > 4096):
        data = bytearray(f.read_bytes())
        data[len(data) * 3 // 4] ^= 0xFF  # a late layer: the first layers load fine
        f.write_bytes(bytes(data))
    with _engine(model, tok, path, prefetch=False, itl_budget_steps=1.001) as eng:
        eng.executor.eos_ids = frozenset()
        # its own system prompt: it shares no (corrupt) chunk with the hit
        streaming = eng.submit(RagPrompt("stream", (DOC_C,), "Answer at length."), SamplingParams(max_new_tokens=200))
        it = iter(streaming)
        next(it)
        r = eng.generate("kafka?", [DOC_A, DOC_B])
        assert eng.stats().step_budget["layers_per_step"] == 1
        streaming.cancel()
        dropped = eng.cache.stats().corrupt_chunks_dropped
    assert r.metrics.recomputed_after_error >= 1
    assert r.token_ids == ref.token_ids
    assert torch.equal(r.first_token_logits, ref.first_token_logits)
    assert dropped > 0


def test_unclaimed_announcement_expires(tmp_path):
    model, tok = tiny_model("llama", num_layers=2)
    with _engine(model, tok, tmp_path / "exp", announce_ttl_s=0.2) as eng:
        eng.announce([DOC_C])
        assert len(eng.window_snapshot()) == 1
        assert _wait_until(lambda: eng.stats().prefetch["expired"] == 1, timeout=10)
        assert eng.window_snapshot() == []
        r = eng.generate("bloom?", [DOC_C])
    assert not r.metrics.announced


def test_dram_smaller_than_one_request_spills_to_ssd_and_reuses(tmp_path):
    """DRAM holds 3 chunks, the prompt ~130: write-back backpressure streams the chain to SSD, nothing is lost."""
    model, tok = tiny_model("llama", num_layers=2)
    chunk_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x K/V x kv_heads x tokens x head_dim x fp32
    doc = "The quick brown fox jumps over the lazy dog near the river bank. " * 40
    with _engine(model, tok, tmp_path / "spill", dram_capacity=3 * chunk_bytes) as eng:
        r1 = eng.generate("q1", [doc])
        r2 = eng.generate("q2", [doc])
        st = eng.cache.stats()
    assert st.bytes_high_water["dram"] <= 3 * chunk_bytes
    assert st.chunks["ssd"] >= r1.metrics.prompt_tokens // 16  # every chunk of the first request was persisted
    assert r2.metrics.reused_by_tier["ssd"] > 0.9 * r1.metrics.prompt_tokens
