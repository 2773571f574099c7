"""Per-tenant quotas of the DRAM and SSD tiers (issue 47, item 6): a chunk is charged to the tenant whose request
computed it, recorded in its SSD file so a restart charges it again, and a tenant at its quota evicts only its own
chunks - so a noisy tenant cannot evict a quiet tenant's working set."""

from __future__ import annotations

import pytest

from pcr_rag.cache import CacheConfig, CacheManager, ManualClock, MemoryBackend, Tier, namespace_key
from pcr_rag.cache.tiers.base import UNATTRIBUTED
from pcr_rag.cache.tiers.chunk_file import ChunkMeta, decode_header, encode_header

from .conftest import Chunks, payload_for

TOKEN_BYTES = 64  # payload_for's default: 2 layers x 2 x 1 head x 4 dims x 4 bytes per token
CHUNK_BYTES = 4 * TOKEN_BYTES
SSD_CHUNK_BYTES = 2 * 4096  # a chunk file: the header and the payload, each padded to 4096

QUIET = namespace_key("test-model", "float32", 4, "quiet")
NOISY = namespace_key("test-model", "float32", 4, "noisy")


def _engine(dram_chunks: int, *, quota_chunks: int | None, ssd_chunks: int = 0, ssd_quota_chunks: int | None = None,
            storage: MemoryBackend | None = None) -> CacheManager:
    cfg = CacheConfig(chunk_size=4, dram_bytes=dram_chunks * CHUNK_BYTES, ssd_bytes=ssd_chunks * SSD_CHUNK_BYTES,
                      sync_io=True,
                      tenant_dram_bytes=None if quota_chunks is None else quota_chunks * CHUNK_BYTES,
                      tenant_ssd_bytes=None if ssd_quota_chunks is None else ssd_quota_chunks * SSD_CHUNK_BYTES)
    return CacheManager(cfg, clock=ManualClock(),
                       storage=storage if storage is not None else (MemoryBackend() if ssd_chunks else None))


def _working_set(tenant_root: bytes, n: int, seed: int) -> list:
    """``n`` one-chunk documents of a tenant (each chained from the tenant's root)."""
    chunks = Chunks(root=tenant_root)
    return [chunks.child(None, [seed + i] * 4) for i in range(n)]


def _stream(eng: CacheManager, tenant: bytes, n: int, seed: int) -> None:
    for spec in _working_set(tenant, n, seed):
        eng.insert(spec, payload_for(spec), tenant=tenant)


@pytest.mark.parametrize("quota", [None, 3])
def test_a_noisy_tenant_streaming_new_chunks_leaves_the_quiet_working_set(quota):
    """DRAM holds 6 chunks; the quiet tenant caches 3, then the noisy one streams 40 new ones. Without quotas LRU
    takes the quiet tenant's chunks; with a 3-chunk quota each (6 >= 3 x 2 tenants) the noisy tenant recycles its
    own and the quiet working set stays whole."""
    eng = _engine(6, quota_chunks=quota)
    quiet = _working_set(QUIET, 3, seed=1000)
    for spec in quiet:
        assert eng.insert(spec, payload_for(spec), tenant=QUIET)
    _stream(eng, NOISY, 40, seed=0)
    kept = sum(1 for s in quiet if Tier.DRAM in eng.tiers_of(s.key))
    eng.check_invariants()
    if quota is None:
        assert kept < 3  # the attack: another tenant's inserts evict the quiet working set
    else:
        assert kept == 3
        used = eng.tenant_bytes(Tier.DRAM)
        assert used == {QUIET: 3 * CHUNK_BYTES, NOISY: 3 * CHUNK_BYTES}
        assert eng.stats().tenants["dram"] == 2


def test_a_tenant_at_its_quota_evicts_its_own_least_recent_chunk():
    eng = _engine(10, quota_chunks=2)
    mine = _working_set(NOISY, 3, seed=0)
    for spec in mine:
        assert eng.insert(spec, payload_for(spec), tenant=NOISY)
    assert [Tier.DRAM in eng.tiers_of(s.key) for s in mine] == [False, True, True]
    assert eng.tenant_bytes(Tier.DRAM) == {NOISY: 2 * CHUNK_BYTES}
    eng.check_invariants()


def test_a_tenant_whose_own_chunks_are_pinned_is_refused_not_served_from_another_tenant():
    """At its quota with its own chunks leased, a tenant gets no room (counted), and nobody else's chunk goes."""
    eng = _engine(10, quota_chunks=2)
    quiet = _working_set(QUIET, 2, seed=1000)
    for spec in quiet:
        assert eng.insert(spec, payload_for(spec), tenant=QUIET)
    mine = _working_set(NOISY, 3, seed=0)
    for spec in mine[:2]:
        assert eng.insert(spec, payload_for(spec), tenant=NOISY)
    with eng.acquire([mine[0].key]), eng.acquire([mine[1].key]):
        assert not eng.insert(mine[2], payload_for(mine[2]), tenant=NOISY)
    assert all(Tier.DRAM in eng.tiers_of(s.key) for s in quiet)
    assert eng.stats().quota_refusals["dram"] >= 1
    eng.check_invariants()


def test_over_committed_capacity_takes_the_inserting_tenants_own_chunks_first():
    """Quotas of 4 chunks, a tier of 5: the tier fills before either tenant reaches its quota; the noisy tenant's
    insert then evicts its own oldest chunk, not the quiet tenant's older ones."""
    eng = _engine(5, quota_chunks=4)
    quiet = _working_set(QUIET, 2, seed=1000)
    for spec in quiet:
        eng.insert(spec, payload_for(spec), tenant=QUIET)
    _stream(eng, NOISY, 4, seed=0)
    assert all(Tier.DRAM in eng.tiers_of(s.key) for s in quiet)
    assert eng.tenant_bytes(Tier.DRAM)[NOISY] == 3 * CHUNK_BYTES
    eng.check_invariants()


def test_a_shared_chunk_counts_against_the_tenant_that_computed_it():
    """A chunk another tenant reuses stays charged to its first inserter; a re-insert charges nobody."""
    eng = _engine(10, quota_chunks=5)
    shared = _working_set(namespace_key("test-model", "float32", 4, ""), 1, seed=7)[0]
    assert eng.insert(shared, payload_for(shared), tenant=QUIET)
    assert eng.insert(shared, payload_for(shared), tenant=NOISY)
    assert eng.tenant_bytes(Tier.DRAM) == {QUIET: CHUNK_BYTES}


def test_ssd_quota_and_the_owner_survive_a_restart():
    """SSD files record their tenant: after a restart the same tenants are charged the same bytes, and the SSD
    quota holds too (the noisy tenant kept only its quota on disk)."""
    backend = MemoryBackend()
    eng = _engine(2, quota_chunks=None, ssd_chunks=8, ssd_quota_chunks=3, storage=backend)
    quiet = _working_set(QUIET, 2, seed=1000)
    for spec in quiet:
        assert eng.insert(spec, payload_for(spec), tenant=QUIET)
    _stream(eng, NOISY, 10, seed=0)
    eng.flush()
    before = eng.tenant_bytes(Tier.SSD)
    assert before == {QUIET: 2 * SSD_CHUNK_BYTES, NOISY: 3 * SSD_CHUNK_BYTES}
    eng.check_invariants()
    eng.close()
    again = _engine(2, quota_chunks=None, ssd_chunks=8, ssd_quota_chunks=3, storage=backend)
    assert again.tenant_bytes(Tier.SSD) == before
    assert all(Tier.SSD in again.tiers_of(s.key) for s in quiet)
    again.check_invariants()
    again.close()


def test_a_restart_with_a_smaller_ssd_quota_trims_each_tenant_to_it():
    backend = MemoryBackend()
    eng = _engine(2, quota_chunks=None, ssd_chunks=8, storage=backend)
    _stream(eng, NOISY, 5, seed=0)
    eng.flush()
    eng.close()
    again = _engine(2, quota_chunks=None, ssd_chunks=8, ssd_quota_chunks=2, storage=backend)
    assert again.tenant_bytes(Tier.SSD) == {NOISY: 2 * SSD_CHUNK_BYTES}
    again.check_invariants()
    again.close()


def test_chunk_headers_record_the_owner_and_old_headers_read_as_unattributed():
    spec = _working_set(QUIET, 1, seed=3)[0]
    payload = payload_for(spec)
    meta = ChunkMeta(spec.key, spec.parent, True, 4, False, b"\x00" * 16)
    for owner, read_back in ((QUIET, QUIET), (b"", UNATTRIBUTED)):
        head = encode_header(ChunkMeta(meta.key, meta.parent, True, 4, False, meta.digest, owner), payload, [0, 0])
        assert decode_header(head, spec.key).meta.owner == read_back
    legacy = decode_header(encode_header(meta, payload, [0, 0]), spec.key)  # a file written before owners
    assert legacy.meta.owner is None
    with pytest.raises(ValueError, match="owner"):
        encode_header(ChunkMeta(meta.key, meta.parent, True, 4, False, meta.digest, b"short"), payload, [0, 0])


def test_quota_configuration_is_checked():
    with pytest.raises(ValueError, match="tenant_dram_bytes"):
        CacheConfig(tenant_dram_bytes=0)
    assert CacheConfig(tenant_ssd_bytes="1KiB").tenant_ssd_bytes == 1024
    eng = _engine(4, quota_chunks=2)
    spec = _working_set(QUIET, 1, seed=0)[0]
    with pytest.raises(ValueError, match="tenant must be"):
        eng.insert(spec, payload_for(spec), tenant=b"not sixteen")


def test_random_inserts_never_take_another_tenants_chunk_when_the_capacity_covers_the_quotas():
    """Three tenants insert chains and lone chunks at random, leasing some while they insert; with DRAM = 3 x the
    quota, no insert changes another tenant's resident chunks, and no tenant ever exceeds its quota."""
    import random

    rng = random.Random(47)
    tenants = [namespace_key("test-model", "float32", 4, f"t{i}") for i in range(3)]
    eng = _engine(12, quota_chunks=4)
    chains: dict[bytes, list] = {t: [] for t in tenants}

    def resident(tenant: bytes) -> set[bytes]:
        return {s.key for specs in chains.values() for s in specs
                if Tier.DRAM in eng.tiers_of(s.key) and s.key in owned_by[tenant]}

    owned_by: dict[bytes, set[bytes]] = {t: set() for t in tenants}
    for step in range(400):
        tenant = rng.choice(tenants)
        mine = chains[tenant]
        parent = rng.choice(mine) if mine and rng.random() < 0.5 else None
        if parent is not None and eng.tiers_of(parent.key) == frozenset():
            parent = None
        spec = Chunks(root=tenant).child(parent, [step] * 4)
        others = {t: resident(t) for t in tenants if t != tenant}
        held = [s for s in mine if eng.tiers_of(s.key)][: rng.randint(0, 2)]
        lease = eng.acquire([held[0].key]) if held else None
        if eng.insert(spec, payload_for(spec), tenant=tenant):
            owned_by[tenant].add(spec.key)
            mine.append(spec)
        if lease is not None:
            lease.release()
        assert {t: resident(t) for t in tenants if t != tenant} == others, f"step {step}"
        assert all(n <= 4 * CHUNK_BYTES for n in eng.tenant_bytes(Tier.DRAM).values())
        eng.check_invariants()
