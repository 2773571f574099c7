"""CacheManager behaviour: match/acquire/insert, pinning, tiers, demotion, loads, supersede, virtual payloads."""

from __future__ import annotations

import pytest
import torch

from pcr_rag.cache import (
    CacheClosedError,
    CacheConfig,
    CacheManager,
    ChunkNotFoundError,
    ManualClock,
    MemoryBackend,
    SlowBackend,
    Tier,
    VirtualPayload,
    namespace_key,
    plan_chunks,
)

# payload_for(spec) default: 2 layers x 2 x 1 head x tokens x 4 dims x 4 bytes = 64 bytes per token
TOKEN_BYTES = 64


def engine(dram_chunks=8, ssd_chunks=0, **kw):
    storage = MemoryBackend() if ssd_chunks else None
    cfg = CacheConfig(
        chunk_size=4,
        dram_bytes=dram_chunks * 4 * TOKEN_BYTES,
        ssd_bytes=ssd_chunks * (4096 + 4 * TOKEN_BYTES),
        sync_io=kw.pop("sync_io", True),
        **kw,
    )
    return CacheManager(cfg, clock=ManualClock(), storage=storage)


def test_insert_match_acquire_and_hit_stats(chunks, make_payload):
    eng = engine()
    path = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]])
    for spec in path:
        assert eng.insert(spec, make_payload(spec))
    other = chunks.child(path[1], [0, 0, 0, 0])
    m = eng.match([s.key for s in path[:2]] + [other.key])
    assert m.num_chunks == 2 and m.num_tokens == 8 and m.tiers == (Tier.DRAM, Tier.DRAM)
    assert eng.stats().lookups == 0  # match is read-only
    with eng.acquire(path[:2] + [other]) as lease:
        assert lease.keys == (path[0].key, path[1].key) and lease.num_tokens == 8
        assert torch.equal(eng.get_payload(path[1].key), make_payload(path[1]))
        assert torch.equal(eng.read_layer(path[1].key, 1), make_payload(path[1])[1])
    st = eng.stats()
    assert st.hit_chunks["dram"] == 2 and st.hit_tokens["dram"] == 8
    assert st.miss_chunks == 1 and st.miss_tokens == 4
    lease = eng.acquire([s.key for s in path], max_chunks=2, total_tokens=8)
    assert lease.num_chunks == 2
    lease.release()
    lease.release()  # idempotent
    assert eng.stats().miss_chunks == 1
    eng.check_invariants()


def test_insert_needs_parent_in_tree(chunks, make_payload):
    eng = engine()
    a, b = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert not eng.insert(b, make_payload(b))
    assert b.key not in eng and eng.stats().inserts_rejected == 1
    assert eng.insert(a, make_payload(a)) and eng.insert(b, make_payload(b))
    assert eng.insert(b, make_payload(b))  # already cached: a touch, nothing added
    assert len(eng) == 2 and eng.stats().bytes_used["dram"] == 8 * TOKEN_BYTES


def test_pinned_chunks_are_never_evicted_and_insert_fails_cleanly(chunks, make_payload):
    eng = engine(dram_chunks=2)
    a = chunks.child(None, [1, 1, 1, 1])
    b = chunks.child(None, [2, 2, 2, 2])
    c = chunks.child(None, [3, 3, 3, 3])
    assert eng.insert(a, make_payload(a)) and eng.insert(b, make_payload(b))
    la, lb = eng.acquire([a.key]), eng.acquire([b.key])
    assert eng.stats().pinned_chunks == 2
    assert not eng.insert(c, make_payload(c))  # everything pinned: no room, nothing stored
    assert c.key not in eng and eng.stats().bytes_used["dram"] == 8 * TOKEN_BYTES
    assert eng.evict(Tier.DRAM, 10**9) == 0
    la.release()
    assert eng.insert(c, make_payload(c))
    assert a.key not in eng and b.key in eng and c.key in eng
    lb.release()
    st = eng.stats()
    assert st.pinned_chunks == 0
    assert st.bytes_high_water["dram"] <= st.capacity_bytes["dram"]
    eng.check_invariants()


def test_payload_larger_than_the_tier_is_rejected(chunks):
    eng = engine(dram_chunks=1)
    spec = chunks.child(None, [1, 2, 3, 4])
    assert not eng.insert(spec, VirtualPayload(10**9, 2))
    assert len(eng) == 0


def test_parent_is_kept_while_making_room_for_its_child(chunks, make_payload):
    eng = engine(dram_chunks=2)
    a, b = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2]])
    x = chunks.child(None, [9, 9, 9, 9])
    assert eng.insert(a, make_payload(a))  # oldest leaf
    assert eng.insert(x, make_payload(x))
    assert eng.insert(b, make_payload(b))  # must evict x, not its own parent a
    assert a.key in eng and b.key in eng and x.key not in eng
    eng.check_invariants()


def test_internal_nodes_become_leaves_and_are_evicted_after_children(chunks, make_payload):
    eng = engine(dram_chunks=3)
    path = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]])
    for s in path:
        assert eng.insert(s, make_payload(s))
    assert eng.leaf_keys(Tier.DRAM) == [path[2].key]
    assert eng.evict(Tier.DRAM, 4 * TOKEN_BYTES) == 4 * TOKEN_BYTES
    assert eng.leaf_keys() == [path[1].key]  # the parent became a leaf
    assert eng.evict(Tier.DRAM, 10**9) == 8 * TOKEN_BYTES
    assert len(eng) == 0
    eng.check_invariants()


def test_dram_eviction_demotes_to_ssd_and_loads_bring_it_back(chunks, make_payload):
    eng = engine(dram_chunks=2, ssd_chunks=8)
    path = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]])
    for s in path:
        assert eng.insert(s, make_payload(s))
    st = eng.stats()
    assert st.writes_done == 4 and st.chunks["ssd"] == 4 and st.chunks["dram"] == 2
    assert st.demotions["dram"] == 2 and st.evictions["dram"] == 2
    m = eng.match([s.key for s in path])
    assert m.tiers == (Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM)
    assert m.locations[0] == frozenset({Tier.SSD}) and m.locations[3] == frozenset({Tier.DRAM, Tier.SSD})
    # a chunk only on SSD: get_payload gives None, read_layer reads and verifies one layer
    assert eng.get_payload(path[0].key) is None
    assert torch.equal(eng.read_layer(path[0].key, 1), make_payload(path[0])[1])
    with eng.acquire(path[:2]):
        assert eng.load([path[0].key, path[1].key]) == 2  # evicts the two DRAM chunks (demotions)
        for s in path[:2]:
            assert torch.equal(eng.get_payload(s.key), make_payload(s))
    fut = eng.load_async([path[2].key, path[3].key])
    assert fut.result(timeout=5) == 2
    st = eng.stats()
    assert st.loads == 4 and st.prefetch_loads == 2
    assert eng.load([path[2].key]) == 0  # already in DRAM
    eng.check_invariants()


def test_ssd_eviction_drops_and_never_orphans(chunks, make_payload):
    eng = engine(dram_chunks=1, ssd_chunks=2)
    a, b = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2]])
    x = chunks.child(None, [7, 7, 7, 7])
    for s in (a, b, x):
        assert eng.insert(s, make_payload(s))
        eng.check_invariants()
    # SSD holds 2 chunks: a was evicted from SSD to make room for x's write-back... unless it had children there
    assert all(eng.tiers_of(k) for k in (a.key, b.key, x.key) if k in eng)
    for k in list(eng.leaf_keys()):
        assert k in eng
    st = eng.stats()
    assert st.chunks["ssd"] <= 2 and st.bytes_high_water["ssd"] <= st.capacity_bytes["ssd"]
    if b.key in eng:
        assert a.key in eng  # a child never outlives its parent
    eng.check_invariants()


def test_partial_leaf_is_superseded_by_a_full_sibling(chunks, make_payload):
    eng = engine()
    head = chunks.child(None, [1, 2, 3, 4])
    partial = chunks.child(head, [5, 6])
    full = chunks.child(head, [5, 6, 7, 8])
    unrelated = chunks.child(head, [9])
    assert eng.insert(head, make_payload(head))
    assert partial.partial and not full.partial and partial.key != full.key
    assert eng.insert(partial, make_payload(partial), tokens=[5, 6])
    assert eng.insert(unrelated, make_payload(unrelated), tokens=[9])
    assert eng.insert(full, make_payload(full), tokens=[5, 6, 7, 8])
    assert partial.key not in eng and unrelated.key in eng and full.key in eng
    assert eng.stats().superseded == 1
    eng.check_invariants()


def test_pinned_partial_is_moved_to_the_front_of_eviction(chunks, make_payload):
    eng = engine(dram_chunks=4)
    head = chunks.child(None, [1, 2, 3, 4])
    partial = chunks.child(head, [5, 6])
    full = chunks.child(head, [5, 6, 7, 8])
    assert eng.insert(head, make_payload(head))
    assert eng.insert(partial, make_payload(partial), tokens=[5, 6])
    with eng.acquire([head.key, partial.key]):
        assert eng.insert(full, make_payload(full), tokens=[5, 6, 7, 8])
        assert partial.key in eng  # in use: kept
    assert eng.leaf_keys(Tier.DRAM)[0] == partial.key
    eng.evict(Tier.DRAM, 1)
    assert partial.key not in eng and full.key in eng


def test_reinsert_of_ssd_only_chunk_brings_it_back_to_dram(chunks, make_payload):
    eng = engine(dram_chunks=1, ssd_chunks=4)
    a = chunks.child(None, [1, 1, 1, 1])
    b = chunks.child(None, [2, 2, 2, 2])
    assert eng.insert(a, make_payload(a)) and eng.insert(b, make_payload(b))
    assert eng.tiers_of(a.key) == {Tier.SSD}
    assert eng.insert(a, make_payload(a))
    assert eng.tiers_of(a.key) == {Tier.DRAM, Tier.SSD}
    assert eng.stats().writes_done == 2  # no second write of a
    eng.check_invariants()


def test_virtual_payloads_in_sync_mode_are_deterministic():
    root = namespace_key("sim", "float16", 256)

    def run() -> dict:
        cfg = CacheConfig(chunk_size=256, dram_bytes="40MB", ssd_bytes="150MB", sync_io=True)
        eng = CacheManager(cfg, clock=ManualClock(), storage=MemoryBackend())
        for req in range(300):
            doc = req * 7919 % 23 % 11
            plan = plan_chunks(root, [[doc] * 600, [req % 5] * 100], 256)
            with eng.acquire(plan) as lease:
                for spec in plan[lease.num_chunks :]:
                    assert eng.insert(spec, VirtualPayload(spec.num_tokens * 20_000, 24))
            eng.set_lookahead([s.key for s in plan])
        eng.check_invariants()
        assert eng.stats().bytes_used["dram"] <= 40_000_000
        assert eng.read_layer(plan[0].key, 3) == VirtualPayload(256 * 20_000 // 24, 1)
        return eng.stats().as_dict()

    first, second = run(), run()
    assert first == second
    assert first["hit_chunks"]["ssd"] > 0 and first["demotions"]["dram"] > 0
    assert first["evictions"]["ssd"] > 0 and first["writes_done"] > 0


def test_payload_validation(chunks):
    eng = engine()
    spec = chunks.child(None, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="tokens"):
        eng.insert(spec, torch.zeros(2, 2, 1, 3, 4))
    with pytest.raises(ValueError, match="shape"):
        eng.insert(spec, torch.zeros(2, 4, 4))
    with pytest.raises(TypeError):
        eng.insert(spec, [1, 2, 3])
    with pytest.raises(ValueError):
        eng.insert(spec, torch.zeros(2, 2, 1, 4, 4), tokens=[1, 2])
    with pytest.raises(ChunkNotFoundError):
        eng.read_layer(spec.key, 0)


def test_closed_engine_refuses_work(chunks, make_payload):
    eng = engine(ssd_chunks=4, sync_io=False)
    spec = chunks.child(None, [1, 2, 3, 4])
    assert eng.insert(spec, make_payload(spec))
    eng.close()
    eng.close()
    with pytest.raises(CacheClosedError):
        eng.insert(spec, make_payload(spec))
    with pytest.raises(CacheClosedError):
        eng.acquire([spec.key])


@pytest.mark.timeout(30)
def test_async_writeback_never_loses_chunks_under_dram_pressure(chunks, make_payload):
    """DRAM holds 2 chunks, the disk is slow: inserts wait for write-back instead of dropping pending chunks."""
    storage = SlowBackend(MemoryBackend(), latency_s=0.02)
    cfg = CacheConfig(chunk_size=4, dram_bytes=2 * 4 * TOKEN_BYTES, ssd_bytes=10**6, sync_io=False)
    eng = CacheManager(cfg, storage=storage)
    path = chunks.path([[i] * 4 for i in range(6)])
    for s in path:
        assert eng.insert(s, make_payload(s))
    eng.flush(timeout=10)
    st = eng.stats()
    assert st.writes_done == 6 and st.writeback_queue_depth == 0
    assert eng.match([s.key for s in path]).num_chunks == 6
    assert st.bytes_high_water["dram"] <= 2 * 4 * TOKEN_BYTES
    eng.check_invariants()
    eng.close()


def test_pinned_footprint_is_the_host_allocators_power_of_two():
    from pcr_rag.cache.tiers.memory import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 192, 256, 257)] == [0, 1, 256, 256, 512]
    smollm2_chunk = 256 * 30 * 2 * 3 * 64 * 2  # tokens x layers x (K, V) x kv heads x head dim x bf16 bytes
    assert pinned_footprint(smollm2_chunk) == 8 << 20


def test_a_pinned_dram_tier_charges_what_is_locked_and_returns_it(chunks, fake_pinned):
    """On a GPU host the DRAM tier's copies are page-locked, and PyTorch's host allocator rounds each up to a power
    of two: the budget counts that, so it bounds the memory really locked (a 192-byte chunk locks 256 bytes)."""
    from pcr_rag.cache.tiers.base import ChunkRecord
    from pcr_rag.cache.tiers.memory import MemoryTier

    record = ChunkRecord(key=b"k" * 16, parent_key=b"p" * 16, parent_is_root=True, num_tokens=4, partial=False,
                         tokens_digest=None, nbytes=192, num_layers=2)
    assert MemoryTier(Tier.DRAM, 1024, pin_memory=True).charge(record) == 256
    assert MemoryTier(Tier.DRAM, 1024).charge(record) == 192  # unpinned: the payload's bytes
    assert MemoryTier(Tier.DRAM, 1024, pin_memory=True).charge(record._replace(virtual=True)) == 192

    eng = CacheManager(CacheConfig(chunk_size=4, dram_bytes=3 * 256, sync_io=True, device="cuda:0", pin_memory=True),
                      clock=ManualClock())
    path = [chunks.child(None, [i, i, i, i]) for i in range(4)]  # four documents' first chunks
    for i, spec in enumerate(path):  # 192 bytes each
        assert eng.insert(spec, torch.full((2, 2, 1, 4, 3), float(i)))
        eng.check_invariants()
    assert eng.stats().bytes_used["dram"] == 3 * 256, "three chunks lock 256 bytes each; the fourth evicted one"
    assert eng.stats().chunks["dram"] == 3
    assert eng.evict(Tier.DRAM, 3 * 256) == 3 * 256
    assert eng.stats().bytes_used["dram"] == 0
    eng.check_invariants()


def test_loads_into_a_pinned_dram_tier_charge_the_locked_bytes(chunks, fake_pinned):
    eng = CacheManager(CacheConfig(chunk_size=4, dram_bytes=2 * 256, ssd_bytes=8 * 4096, sync_io=True,
                                  device="cuda:0", pin_memory=True), clock=ManualClock(), storage=MemoryBackend())
    path = [chunks.child(None, [i, i, i, i]) for i in range(4)]
    for i, spec in enumerate(path):  # 192 bytes each, 256 locked
        assert eng.insert(spec, torch.full((2, 2, 1, 4, 3), float(i)))
    assert eng.stats().chunks["dram"] == 2 and eng.stats().chunks["ssd"] == 4
    assert eng.load([path[0].key, path[1].key]) == 2  # from SSD, evicting the two in DRAM
    assert eng.stats().bytes_used["dram"] == 2 * 256
    assert torch.equal(eng.get_payload(path[0].key), torch.full((2, 2, 1, 4, 3), 0.0))
    eng.check_invariants()
    assert eng.insert(path[2], torch.full((2, 2, 1, 4, 3), 2.0))  # a refresh of a chunk only on SSD
    assert eng.stats().bytes_used["dram"] == 2 * 256
    eng.check_invariants()
