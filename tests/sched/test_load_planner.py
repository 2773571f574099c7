"""The load-or-recompute planner in the engine (tiny model): the same request gives the same tokens and first-token
logits with its cached chunks loaded, recomputed, or some of each, and the planner's choices are counted."""

from __future__ import annotations

import logging

import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import Tier
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOC_A = "Kafka stores ordered records in partitions that consumers read at their own pace. " * 6
DOC_B = "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 6
QUESTION = "what do the documents say?"


def _engine(model, tok, path, **kw) -> PCREngine:
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="64MiB", ssd_capacity="256MiB", max_new_tokens=6,
               device=TEST_DEVICE, dtype="float32", prefetch=False, warmup=False, load_planner="measured")
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def _only_on_ssd(eng: PCREngine) -> list[bytes]:
    """Every cached chunk of the request on SSD only; returns the request's matched keys."""
    eng.flush()
    eng.cache.evict(Tier.DRAM, 1 << 30)
    keys = [c.key for c in eng.plan_for(QUESTION, [DOC_A, DOC_B])]
    matched = eng.cache.match(keys)
    assert matched.num_chunks > 2 and set(matched.tiers) == {Tier.SSD}
    return list(matched.keys)


def test_loaded_recomputed_and_mixed_chunks_give_identical_answers(tmp_path, caplog):
    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    with _engine(model, tok, tmp_path / "off", enable_cache=False) as off:
        ref = off.generate(QUESTION, [DOC_A, DOC_B])

    with _engine(model, tok, tmp_path / "loaded", load_planner="always-load") as eng:
        eng.generate(QUESTION, [DOC_A, DOC_B])
        _only_on_ssd(eng)
        eng.cache.planner.observe_read(Tier.SSD, 1.0)  # 1 B/s: ignored by always-load
        loaded = eng.generate(QUESTION, [DOC_A, DOC_B])
        assert loaded.metrics.reused_by_tier["ssd"] > 0 and loaded.metrics.reused_by_tier["dram"] == 0
        assert sum(eng.stats().cache.recomputed_instead_of_loaded.values()) == 0

    with _engine(model, tok, tmp_path / "measured") as eng:
        eng.generate(QUESTION, [DOC_A, DOC_B])
        keys = _only_on_ssd(eng)
        eng.cache.planner.observe_read(Tier.SSD, 1.0)  # a disk far slower than computing: recompute it all
        with caplog.at_level(logging.DEBUG, logger="pcr_rag.cache.manager"):
            recomputed = eng.generate(QUESTION, [DOC_A, DOC_B])
        assert recomputed.metrics.reused_tokens == 0
        assert eng.stats().cache.recomputed_instead_of_loaded["ssd"] == len(keys)
        assert any("reuse plan: 0 of" in r.message for r in caplog.records)

        # mixed: the front back in DRAM (loaded), the rest still only on a slow SSD (recomputed)
        eng.flush()
        eng.cache.evict(Tier.DRAM, 1 << 30)
        front = keys[:2]
        assert eng.cache.load(front) == 2
        eng.cache.planner.observe_read(Tier.SSD, 1.0)  # the requests above re-measured it on the real disk
        mixed = eng.generate(QUESTION, [DOC_A, DOC_B])
        assert mixed.metrics.reused_by_tier["dram"] > 0 and mixed.metrics.reused_by_tier["ssd"] == 0
        assert mixed.metrics.computed_tokens < ref.metrics.prompt_tokens

    for got in (loaded, recomputed, mixed):
        assert got.token_ids == ref.token_ids
        assert torch.equal(got.first_token_logits, ref.first_token_logits)


def test_the_planner_mode_reaches_the_cache_and_the_prefill_step(tmp_path):
    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    with _engine(model, tok, tmp_path / "c", load_planner="always-load", prefill_chunk_tokens=32,
                 layerwise=False) as eng:
        planner = eng.cache.planner
        assert planner.mode == "always-load" and planner.step_tokens == 32 and not planner.layerwise
        eng.generate(QUESTION, [DOC_A])
        assert eng.stats().cache.planner["compute_s_per_token"] > 0  # the runtime's steps reach the planner
