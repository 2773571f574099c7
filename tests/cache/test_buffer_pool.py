"""`BufferPool`: dropped DRAM copies are reused for new payloads only when nothing else references their bytes,
and an engine whose DRAM tier is full reuses them with exact answers, SSD round trips included."""

from __future__ import annotations

import numpy as np
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.buffer_pool import BufferPool
from pcr_rag.testing import tiny_model

SHAPE = (2, 2, 1, 16, 4)


def test_a_buffer_nobody_holds_is_reused_once():
    pool = BufferPool()
    t = torch.full(SHAPE, 7.0)
    address = t.data_ptr()
    pool.give(t)
    del t
    got = pool.take(SHAPE, torch.float32)
    assert got.data_ptr() == address and (pool.reused, pool.allocated) == (1, 0)
    assert pool.take(SHAPE, torch.float32).data_ptr() != address  # handed out once only
    assert (pool.reused, pool.allocated) == (1, 1)


def test_views_references_and_numpy_arrays_keep_a_buffer_out_of_use():
    pool = BufferPool()
    t = torch.full(SHAPE, 7.0)
    view, array = t[0], t.numpy()
    pool.give(t)
    address = t.data_ptr()
    assert pool.take(SHAPE, torch.float32).data_ptr() != address  # the caller still holds `t`
    del t
    assert pool.take(SHAPE, torch.float32).data_ptr() != address  # a view shares the storage
    del view
    assert isinstance(array, np.ndarray)
    assert pool.take(SHAPE, torch.float32).data_ptr() != address  # a numpy array holds the tensor
    del array
    assert pool.take(SHAPE, torch.float32).data_ptr() == address
    assert pool.reused == 1


def test_only_the_same_shape_and_dtype_and_whole_unpinned_cpu_tensors():
    pool = BufferPool()
    pool.give(torch.zeros(SHAPE))
    assert pool.take((2, 2, 1, 8, 4), torch.float32) is not None and pool.reused == 0
    assert pool.take(SHAPE, torch.bfloat16).dtype == torch.bfloat16 and pool.reused == 0
    pool.give(torch.zeros(2, *SHAPE)[1])               # a slice of a larger storage
    pool.give(torch.zeros(SHAPE).transpose(0, 1))      # not contiguous
    pool.give("not a tensor")
    assert len(pool) == 1
    assert pool.take(SHAPE, torch.float32) is not None and pool.reused == 1


def test_the_pool_keeps_at_most_max_buffers_oldest_out_first():
    pool = BufferPool(max_buffers=2)
    kept = [torch.zeros(SHAPE) for _ in range(3)]
    addresses = [t.data_ptr() for t in kept]
    for t in kept:
        pool.give(t)
    del kept, t
    assert len(pool) == 2
    got = {pool.take(SHAPE, torch.float32).data_ptr() for _ in range(2)}
    assert got == set(addresses[1:])
    assert BufferPool(max_buffers=0).take(SHAPE, torch.float32).shape == SHAPE


def test_an_engine_with_a_full_dram_tier_reuses_buffers_with_exact_answers(tmp_path):
    """A DRAM tier of four chunks: every new chunk evicts one (written back to SSD first), so later payloads are
    written into dropped copies' buffers. Answers equal the cache-off engine's bit for bit, also when the repeats
    read their prefixes back from SSD files written from buffers that were reused afterwards."""
    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    docs = [f"Report {i}: the river {i} floods its valley every spring, and farmers plant after it. " * 3
            for i in range(6)]
    requests = [(f"When does river {i} flood?", [docs[i], docs[(i + 1) % 6]]) for i in range(6)]
    chunk = 16
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    chunk_bytes = 2 * 2 * model.config.num_key_value_heads * chunk * head_dim * 4

    def run(name: str, **kw) -> tuple[list, dict]:
        cfg = EngineConfig(cache_dir=tmp_path / name, chunk_size=chunk, ssd_capacity="64MiB", max_new_tokens=6,
                           device="cpu", dtype="float32", load_planner="always-load", **kw)
        with PCREngine(model=model, tokenizer=tok, config=cfg) as eng:
            out = [eng.generate(q, d) for q, d in requests]
            eng.flush()
            out += [eng.generate(q, d) for q, d in requests]
            stats = eng.stats().cache
            if eng.cache is not None:
                eng.cache.check_invariants()
        return out, stats

    ref, _ = run("off", enable_cache=False)
    got, stats = run("on", dram_capacity=4 * chunk_bytes)
    assert stats.dram_buffers_reused > 0
    assert stats.hit_tokens["ssd"] > 0
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)
