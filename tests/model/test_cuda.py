"""The CUDA paths: the device tier, pinned DRAM payloads and the layer-wise loads and offloads on side streams.

Skipped without a CUDA device (CI has none); run on a GPU machine by `pcr_rag.bench.device_check`, together with
the device-agnostic engine tests under ``PCR_RAG_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DOCS = [
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 5,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 4,
    "Bloom filters answer membership queries with false positives but never false negatives. " * 6,
]
REQUESTS = [("What does Kafka store?", (0, 1)), ("What is descent?", (1, 2)), ("Kafka order?", (0, 1)),
            ("False negatives?", (2, 0)), ("Again Kafka?", (0, 1, 2))]


def _run(model, tok, path, **kw) -> tuple[list, dict]:
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="64MiB", ssd_capacity="256MiB", max_new_tokens=6,
               device="cuda", prefill_chunk_tokens=32)
    cfg.update(kw)
    with PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg)) as eng:
        runs = [eng.generate(q, [DOCS[i] for i in d]) for q, d in REQUESTS]
        eng.flush()
        runs += [eng.generate(q, [DOCS[i] for i in d]) for q, d in REQUESTS]  # everything cached now
        return runs, eng.stats().as_dict()


def _assert_same(ref: list, got: list) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_token_logits.cpu(), b.first_token_logits.cpu())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_tier_on_cuda_replays_the_uncached_answer(arch, dtype, tmp_path):
    """Hits served from the device tier, from pinned DRAM and from SSD, with layer-wise overlap on and off, all
    equal the cache-off run on the same GPU bit for bit."""
    model, tok = tiny_model(arch, dtype=dtype)
    ref, _ = _run(model, tok, tmp_path / "off", enable_cache=False, dtype=dtype)
    variants = {
        "device": dict(device_capacity="16MiB"),
        "dram": dict(),
        "dram-serial": dict(layerwise=False),
        "ssd": dict(dram_capacity=64 * 1024),
        "ssd-serial": dict(dram_capacity=64 * 1024, layerwise=False),
    }
    for name, kw in variants.items():
        got, stats = _run(model, tok, tmp_path / name, dtype=dtype, **kw)
        _assert_same(ref, got)
        by_tier = stats["requests"]["reused_by_tier"]
        tier = name.split("-")[0]
        assert by_tier[tier] > 0, f"{name}: expected hits from the {tier} tier, got {by_tier}"


def test_cuda_engine_runs_on_the_gpu_with_pinned_dram(tmp_path):
    """The model and the copy engine are on the GPU; the DRAM tier keeps page-locked payloads, so the side-stream
    copies are asynchronous (the tier's pinning itself: tests/cache/test_device_tier.py)."""
    model, tok = tiny_model("llama", dtype=torch.bfloat16)
    cfg = EngineConfig(cache_dir=tmp_path / "c", chunk_size=16, dram_capacity="64MiB", ssd_capacity="64MiB",
                       max_new_tokens=4, device="cuda", dtype=torch.bfloat16)
    with PCREngine(model=model, tokenizer=tok, config=cfg) as eng:
        r = eng.generate(REQUESTS[0][0], [DOCS[i] for i in REQUESTS[0][1]])
        assert eng.device.type == "cuda" and next(model.parameters()).is_cuda
        assert eng.copy_engine.is_cuda and eng.cache.config.pin_dram
    assert r.token_ids
