"""Belady (MIN) on prefix-chunk traces: hand example, and never below LRU on random traces."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from pcr_rag.sim.belady import TraceChunk, belady


def _chain(doc_seq: list[int], per_doc: int = 1) -> list[TraceChunk]:
    """Chunks of a request whose documents are ``doc_seq`` (keys chain over the whole prefix)."""
    out = []
    prefix: tuple = ()
    for d in doc_seq:
        for j in range(per_doc):
            prefix = (*prefix, (d, j))
            out.append(TraceChunk(repr(prefix).encode(), 1, 10))
    return out


def _prefix_lru(trace, capacity: int) -> int:
    """Reference prefix-tree LRU (leaf-only eviction, always admit), capacity in chunks; returns chunk hits."""
    cache: OrderedDict[bytes, bytes | None] = OrderedDict()  # key -> parent, in recency order
    children: dict[bytes, int] = {}
    hits = 0
    for req in trace:
        parent = None
        matched = True
        for c in req:
            if matched and c.key in cache:
                hits += 1
                cache.move_to_end(c.key)
            else:
                matched = False
                if c.key in cache:
                    cache.move_to_end(c.key)
                else:
                    while len(cache) >= capacity:
                        victim = next((k for k in cache if children.get(k, 0) == 0 and k != parent), None)
                        if victim is None:
                            break
                        vp = cache.pop(victim)
                        if vp is not None:
                            children[vp] -= 1
                    if len(cache) >= capacity:
                        break
                    cache[c.key] = parent
                    if parent is not None:
                        children[parent] = children.get(parent, 0) + 1
            parent = c.key
    return hits


def test_belady_hand_example():
    # capacity 1 chunk; requests A, B, A: MIN keeps A (used again) and bypasses B -> 1 hit; LRU -> 0 hits.
    a, b = _chain([1]), _chain([2])
    res = belady([a, b, a], capacity_bytes=1)
    assert (res.hit_chunks, res.total_chunks) == (1, 3)
    assert res.hit_tokens == 10 and res.total_tokens == 30
    assert _prefix_lru([a, b, a], 1) == 0


def test_belady_keeps_prefix_tree():
    # a child is only hit with its parent: [1,2] then [3] then [1,2] with capacity 2 keeps both chunks of [1,2]
    t = [_chain([1, 2]), _chain([3]), _chain([1, 2])]
    res = belady(t, capacity_bytes=2)
    assert res.hit_chunks == 2
    # with capacity 1 only the first chunk can be kept; the second alone would be useless
    assert belady(t, capacity_bytes=1).hit_chunks == 1


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=3, unique=True), min_size=1, max_size=40),
    capacity=st.integers(1, 8),
)
def test_belady_never_below_lru(reqs, capacity):
    trace = [_chain(r) for r in reqs]
    b = belady(trace, capacity_bytes=capacity)
    assert b.hit_chunks >= _prefix_lru(trace, capacity)
    # never more hits than re-uses exist (every first touch misses)
    seen: set[bytes] = set()
    reuses = 0
    for r in trace:
        for c in r:
            reuses += c.key in seen
            seen.add(c.key)
    assert b.hit_chunks <= reuses
