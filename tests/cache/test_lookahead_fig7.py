"""The paper's Figure 7 example: look-ahead LRU keeps C2 and evicts C4; plain LRU evicts C2.

Tree (leaf set {C2, C4, C6, C8}, C2 the oldest leaf, C4 the second oldest)::

    root ─ C1 ─ C2
           └─── C3 ─ C4
    root ─ C5 ─ C6
    root ─ C7 ─ C8 ─ (C9 is inserted here)

The cache holds eight chunks; inserting C9 needs one eviction. The next request in the waiting queue needs C1, C2.
"""

from __future__ import annotations

import pytest

from pcr_rag.cache import CacheConfig, CacheManager, ManualClock, Tier, VirtualPayload

CHUNK_BYTES = 1000


def build(chunks, policy: str):
    clock = ManualClock()
    engine = CacheManager(
        CacheConfig(chunk_size=4, dram_bytes=8 * CHUNK_BYTES, policy=policy, sync_io=True), clock=clock
    )
    c = {}
    c[1] = chunks.child(None, [1, 1, 1, 1])
    c[2] = chunks.child(c[1], [2, 2, 2, 2])
    c[3] = chunks.child(c[1], [3, 3, 3, 3])
    c[4] = chunks.child(c[3], [4, 4, 4, 4])
    c[5] = chunks.child(None, [5, 5, 5, 5])
    c[6] = chunks.child(c[5], [6, 6, 6, 6])
    c[7] = chunks.child(None, [7, 7, 7, 7])
    c[8] = chunks.child(c[7], [8, 8, 8, 8])
    c[9] = chunks.child(c[8], [9, 9, 9, 9])
    for i in range(1, 9):
        clock.advance(1.0)
        assert engine.insert(c[i], VirtualPayload(CHUNK_BYTES, 2))
    return engine, clock, c


def names(keys, c):
    inv = {spec.key: f"C{i}" for i, spec in c.items()}
    return {inv[k] for k in keys}


@pytest.mark.parametrize("policy", ["lookahead-lru", "lru"])
def test_figure7_initial_leaf_set(chunks, policy):
    engine, _, c = build(chunks, policy)
    assert names(engine.leaf_keys(), c) == {"C2", "C4", "C6", "C8"}
    assert engine.leaf_keys(Tier.DRAM)[:2] == [c[2].key, c[4].key]  # C2 oldest, C4 second oldest
    engine.check_invariants()


def test_figure7_lookahead_lru_keeps_c2_and_evicts_c4(chunks):
    engine, clock, c = build(chunks, "lookahead-lru")
    engine.set_lookahead([c[1].key, c[2].key])  # the next request in the waiting queue needs C1, C2
    clock.advance(1.0)
    assert engine.insert(c[9], VirtualPayload(CHUNK_BYTES, 2))
    assert c[2].key in engine and c[4].key not in engine
    assert names(engine.leaf_keys(), c) == {"C6", "C2", "C3", "C9"}
    st = engine.stats()
    assert st.evictions["dram"] == 1 and st.bytes_used["dram"] == 8 * CHUNK_BYTES
    engine.check_invariants()
    # the protected request now hits both chunks
    with engine.acquire([c[1].key, c[2].key]) as lease:
        assert lease.num_chunks == 2


def test_figure7_plain_lru_evicts_c2(chunks):
    engine, clock, c = build(chunks, "lru")
    engine.set_lookahead([c[1].key, c[2].key])  # ignored by plain LRU
    clock.advance(1.0)
    assert engine.insert(c[9], VirtualPayload(CHUNK_BYTES, 2))
    assert c[2].key not in engine and c[4].key in engine
    assert names(engine.leaf_keys(), c) == {"C4", "C6", "C9"}
    engine.check_invariants()
    with engine.acquire([c[1].key, c[2].key]) as lease:
        assert lease.num_chunks == 1  # C2 has to be recomputed
