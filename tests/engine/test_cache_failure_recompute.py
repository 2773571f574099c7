"""A failing tier recomputes (issue 47, item 7): a cache or store failure during a request's lease - a tier read
raising or timing out, a checksum failing mid-load, a memory copy that cannot be read, the lease itself raising -
makes that request recompute the affected chunks, counted, and its tokens and first-token logits equal the
cache-off run's. Faults are injected through `FaultyBackend` (reads) and by making the cache's own calls raise."""

from __future__ import annotations

import errno

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.storage import FaultyBackend, LocalDirBackend
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOC_A = "Kafka stores ordered records in partitions that consumers read at their own pace. " * 6
DOC_B = "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 6
QUERY = "what is kafka?"


def _engine(model, tok, path, storage=None, **kw) -> PCREngine:
    """``load_planner="always-load"``: every cached chunk is leased and loaded, so the fault hits a load the planner
    already chose (the planner deciding to recompute instead is its own matter, `cache.reuse_planner`)."""
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="64MiB", ssd_capacity="256MiB", max_new_tokens=6,
               device=TEST_DEVICE, prefetch=False, load_planner="always-load")
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg), storage=storage)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=3)


@pytest.fixture(scope="module")
def reference(tiny):
    model, tok = tiny
    with _engine(model, tok, None, enable_cache=False) as eng:
        return eng.generate(QUERY, [DOC_A, DOC_B])


def _assert_exact(r, ref) -> None:
    assert r.token_ids == ref.token_ids
    assert torch.equal(r.first_token_logits, ref.first_token_logits)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("fault", [TimeoutError("SSD read timed out"), OSError(errno.EIO, "I/O error"),
                                   RuntimeError("the backend broke")], ids=["timeout", "eio", "runtime"])
def test_ssd_reads_failing_during_the_lease_recompute(tiny, reference, tmp_path, fault, layerwise):
    """The prefix is on SSD only (DRAM off); every read of it fails after the lease was taken. Before, a load
    that was not layer-wise failed the request (`PrefixLoadError` escaped `begin`)."""
    model, tok = tiny
    path = tmp_path / "c"
    with _engine(model, tok, path) as warm:
        warm.generate(QUERY, [DOC_A, DOC_B])
        warm.flush()
    faulty = FaultyBackend(LocalDirBackend(path))
    with _engine(model, tok, path, storage=faulty, dram_capacity=0, layerwise=layerwise) as eng:
        assert eng.cache.match([c.key for c in eng.plan_for(QUERY, [DOC_A, DOC_B])]).num_chunks > 0
        faulty.read_fault = fault
        r = eng.generate(QUERY, [DOC_A, DOC_B])
        stats = eng.stats()
    _assert_exact(r, reference)
    assert faulty.read_failures > 0
    assert r.metrics.recomputed_after_error >= 1
    assert r.metrics.reused_tokens < r.metrics.prompt_tokens - 1
    assert stats.requests["recomputed_after_error"] >= 1
    assert stats.requests["requests_failed"] == 0


def test_a_chunk_failing_its_checksum_mid_load_recomputes_without_layerwise(tiny, reference, tmp_path):
    """A flipped byte in a late layer: the first layers load, then the checksum fails; with ``layerwise=False``
    this failed the request before."""
    model, tok = tiny
    path = tmp_path / "c"
    with _engine(model, tok, path) as warm:
        warm.generate(QUERY, [DOC_A, DOC_B])
        warm.flush()
    for f in sorted(p for p in path.rglob("*.kv")):
        data = bytearray(f.read_bytes())
        data[len(data) * 3 // 4] ^= 0xFF
        f.write_bytes(bytes(data))
    with _engine(model, tok, path, dram_capacity=0, layerwise=False) as eng:
        r = eng.generate(QUERY, [DOC_A, DOC_B])
        dropped = eng.cache.stats().corrupt_chunks_dropped
    _assert_exact(r, reference)
    assert dropped > 0 and r.metrics.recomputed_after_error >= 1


class _UnreadableCopy:
    """A DRAM copy whose layers cannot be read (a broken memory tier)."""

    def __getitem__(self, layer: int) -> torch.Tensor:
        raise RuntimeError("DRAM copy unreadable")


def test_a_dram_copy_that_raises_recomputes(tiny, reference, tmp_path):
    """On CPU a prefix held in memory is copied inline on the compute thread; a copy that raised there escaped as
    a plain error and failed the request."""
    model, tok = tiny
    with _engine(model, tok, None, ssd_capacity=0) as eng:
        eng.generate(QUERY, [DOC_A, DOC_B])
        real = eng.cache.get_payload
        eng.cache.get_payload = lambda key: None if real(key) is None else _UnreadableCopy()  # type: ignore[method-assign]
        r = eng.generate(QUERY, [DOC_A, DOC_B])
        eng.cache.get_payload = real  # type: ignore[method-assign]
        again = eng.generate(QUERY, [DOC_A, DOC_B])
    _assert_exact(r, reference)
    assert r.metrics.recomputed_after_error >= 1
    _assert_exact(again, reference)


def test_a_lease_that_raises_recomputes_the_whole_prompt(tiny, reference, tmp_path):
    """The cache's lookup itself fails (a store timing out inside ``acquire``): the request computes every token
    and still answers exactly."""
    model, tok = tiny
    with _engine(model, tok, tmp_path / "c") as eng:
        eng.generate(QUERY, [DOC_A, DOC_B])

        def broken(*args, **kwargs):
            raise TimeoutError("the store did not answer the lookup")

        real = eng.cache.acquire
        eng.cache.acquire = broken  # type: ignore[method-assign]
        r = eng.generate(QUERY, [DOC_A, DOC_B])
        eng.cache.acquire = real  # type: ignore[method-assign]
        stats = eng.stats()
    _assert_exact(r, reference)
    assert r.metrics.reused_tokens == 0 and r.metrics.computed_tokens == r.metrics.prompt_tokens
    assert r.metrics.recomputed_after_error == 1
    assert stats.requests["requests_failed"] == 0


def test_the_recompute_counter_is_on_metrics(tiny, tmp_path):
    """``pcr:cache_failures_recomputed_total`` on /metrics counts the fallbacks."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pcr_rag.server.metrics import _EngineCollector

    model, tok = tiny
    path = tmp_path / "c"
    with _engine(model, tok, path) as warm:
        warm.generate(QUERY, [DOC_A, DOC_B])
        warm.flush()
    faulty = FaultyBackend(LocalDirBackend(path))
    with _engine(model, tok, path, storage=faulty, dram_capacity=0) as eng:
        faulty.read_fault = TimeoutError("SSD read timed out")
        r = eng.generate(QUERY, [DOC_A, DOC_B])
        registry = CollectorRegistry()
        registry.register(_EngineCollector("tiny", eng.stats))
        text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("pcr:cache_failures_recomputed_total"))
    assert float(line.rsplit(" ", 1)[1]) == r.metrics.recomputed_after_error >= 1
