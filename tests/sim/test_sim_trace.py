"""The simulator's chunk plans are the runtime's: equal to plan_chunks on the same segments."""

from __future__ import annotations

from pcr_rag.cache.keys import namespace_key, plan_chunks
from pcr_rag.sim.trace import TraceBuilder, lognormal_lengths, synthetic_tokens


def test_trace_builder_equals_plan_chunks():
    root = namespace_key("m", "float16", 16)
    lengths = {"a": 40, "b": 16, "c": 7}
    system = synthetic_tokens("sys", 20)
    tb = TraceBuilder(root, 16, lambda d: synthetic_tokens(d, lengths[d]), system_tokens=system, question_tokens=5)
    for rid, docs in enumerate([("a", "b"), ("a", "c"), ("b", "a", "c"), ("a", "b")]):
        q = tb.question(rid)
        got = tb.plan(docs, q)
        want = plan_chunks(root, [system, *(synthetic_tokens(d, lengths[d]) for d in docs), q], 16)
        assert list(got) == want
    # a shared first document shares its chunks' keys (prefix reuse), a different order does not
    p1 = tb.plan(("a", "b"), tb.question(10))
    p2 = tb.plan(("a", "c"), tb.question(11))
    p3 = tb.plan(("b", "a"), tb.question(12))
    assert [c.key for c in p1[:4]] == [c.key for c in p2[:4]]  # system (2 chunks) + doc a (3 chunks, 40 tokens)
    assert p1[4].key == p2[4].key and p1[5].key != p2[5].key
    assert p3[2].key != p1[2].key


def test_synthetic_inputs_are_seeded():
    assert synthetic_tokens("x", 10, seed=1) == synthetic_tokens("x", 10, seed=1)
    assert synthetic_tokens("x", 10, seed=1) != synthetic_tokens("x", 10, seed=2)
    a = lognormal_lengths(["d1", "d2", "d3"], mean_tokens=300, seed=3)
    assert a == lognormal_lengths(["d1", "d2", "d3"], mean_tokens=300, seed=3)
    assert all(v >= 16 for v in a.values())
