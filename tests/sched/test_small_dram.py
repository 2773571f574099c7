"""A DRAM tier that holds one chunk must not switch caching off: while a request pins its matched prefix in
DRAM, its new chunks are written through to SSD, so repeats reuse about as much as with a large DRAM, with
exact answers. Public API only: `PCREngine` on a tiny model."""

from __future__ import annotations

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import TEST_DEVICE, tiny_model

CHUNK = 16  # tokens
TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans"]
DOCS = [
    f"The {t} of the world are studied by many scientists, who measure and map them each year. " * 3
    for t in TOPICS
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


def _chunk_bytes(model) -> int:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * CHUNK * head_dim * 4  # float32 K and V


def _run(tiny, path, **kw):
    """Six requests on fresh documents, then the same six again; returns the answers and the tokens reused by
    the repeats."""
    model, tok = tiny
    cfg = EngineConfig(
        cache_dir=path,
        chunk_size=CHUNK,
        ssd_capacity="64MiB",
        max_new_tokens=6,
        device=TEST_DEVICE,
        dtype="float32",
        load_planner="always-load",  # the SSD path itself: on a tiny model recomputing beats reading, which the planner would choose
        **kw,
    )
    with PCREngine(model=model, tokenizer=tok, config=cfg) as eng:
        first = [eng.generate(f"What do we know about {t}?", [d]) for t, d in zip(TOPICS, DOCS, strict=True)]
        again = [eng.generate(f"What do we know about {t}?", [d]) for t, d in zip(TOPICS, DOCS, strict=True)]
    return first + again, sum(r.metrics.reused_tokens for r in again)


def test_repeats_under_a_one_chunk_dram_reuse_like_a_large_dram(tiny, tmp_path):
    one_chunk = _chunk_bytes(tiny[0])
    off, _ = _run(tiny, tmp_path / "off", enable_cache=False)
    large, large_reuse = _run(tiny, tmp_path / "large", dram_capacity="64MiB")
    small, small_reuse = _run(tiny, tmp_path / "small", dram_capacity=one_chunk)
    assert large_reuse > 0 and small_reuse >= 0.9 * large_reuse, (small_reuse, large_reuse)
    for ref, a, b in zip(off, large, small, strict=True):  # reuse never changes the answer
        assert ref.prompt_token_ids == a.prompt_token_ids == b.prompt_token_ids
        assert ref.token_ids == a.token_ids == b.token_ids
        assert torch.equal(ref.first_token_logits, b.first_token_logits)
