"""Per-tenant quotas through the engine (issue 47, item 6): a noisy tenant that streams new documents leaves a quiet
tenant's reuse unchanged. Without quotas the same stream evicts the quiet tenant's chunks (the attack)."""

from __future__ import annotations

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import Tier
from pcr_rag.testing import TEST_DEVICE, tiny_model

QUIET_DOCS = ["Kafka stores ordered records in partitions that consumers read at their own pace. " * 4,
              "Bloom filters answer membership queries with false positives but never false negatives. " * 4]
TOPICS = ["raft", "paxos", "btrees", "lsm trees", "crdts", "vector clocks", "gossip", "quorums", "sharding",
          "leases", "fencing", "backpressure"]


def _noise(i: int) -> str:
    return f"Notes on {TOPICS[i % len(TOPICS)]}, part {i}: " + f"item {i} of the stream is new text. " * 12


def _scrape(eng: PCREngine) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from pcr_rag.server.metrics import _EngineCollector

    registry = CollectorRegistry()
    registry.register(_EngineCollector("tiny", eng.stats))
    return generate_latest(registry).decode()


def _engine(model, tok, **kw) -> PCREngine:
    cfg = dict(chunk_size=16, ssd_capacity=0, max_new_tokens=2, device=TEST_DEVICE, prefetch=False, warmup=False)
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2)


@pytest.fixture(scope="module")
def footprint(tiny) -> tuple[int, int]:
    """(bytes the quiet tenant's request caches, the most one noisy request caches), measured on a roomy DRAM."""
    model, tok = tiny
    with _engine(model, tok, dram_capacity="64MiB") as eng:
        eng.generate("what is kafka?", QUIET_DOCS, namespace="quiet")
        quiet = eng.cache.tenant_bytes(Tier.DRAM)[eng.root_for("quiet")]
        noisy = 0
        for i in range(3):
            before = eng.cache.tenant_bytes(Tier.DRAM).get(eng.root_for("noisy"), 0)
            eng.generate("summarise", [_noise(i)], namespace="noisy")
            noisy = max(noisy, eng.cache.tenant_bytes(Tier.DRAM)[eng.root_for("noisy")] - before)
    return quiet, noisy


@pytest.mark.parametrize("quotas", [False, True], ids=["no-quota", "quota"])
def test_a_noisy_tenant_streaming_documents_leaves_a_quiet_tenants_reuse(tiny, footprint, quotas):
    model, tok = tiny
    quiet_bytes, noisy_bytes = footprint
    quota = max(quiet_bytes, noisy_bytes) * 5 // 4
    capacity = 2 * quota  # two tenants: the capacity covers both quotas
    kw = dict(tenant_dram_quota=quota) if quotas else {}
    with _engine(model, tok, dram_capacity=capacity, **kw) as eng:
        eng.generate("what is kafka?", QUIET_DOCS, namespace="quiet")
        before = eng.generate("what is kafka?", QUIET_DOCS, namespace="quiet").metrics.reused_tokens
        for i in range(len(TOPICS)):  # several times the tier's capacity of new documents
            eng.generate("summarise", [_noise(i)], namespace="noisy")
        after = eng.generate("what is kafka?", QUIET_DOCS, namespace="quiet").metrics.reused_tokens
        stats = eng.cache.stats()
        used = eng.cache.tenant_bytes(Tier.DRAM)
        eng.cache.check_invariants()
        metrics = _scrape(eng)
    assert before > 0
    assert stats.evictions["dram"] > 0  # the stream did fill the tier
    assert 'pcr:cache_quota_refusals_total{model_name="tiny",tier="dram"}' in metrics
    if quotas:
        assert after == before
        assert all(n <= quota for n in used.values())
    else:
        assert after < before  # the attack the quotas stop


def test_quota_fields_are_validated():
    from pcr_rag.errors import ConfigError

    with pytest.raises(ConfigError, match="tenant_ssd_quota"):
        EngineConfig(tenant_ssd_quota=0)
    with pytest.raises(ConfigError, match="tenant_dram_quota"):
        EngineConfig(tenant_dram_quota="lots")
    assert EngineConfig(tenant_dram_quota="1MiB").tenant_dram_quota == 1 << 20
