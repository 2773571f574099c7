"""Cache-aware document order offline: the best order against what was served, ties to relevance order, and the
reuse bound of a trace in both orders; the offline plan is the engine's own."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest

from pcr_rag.bench.config import SYSTEM_PROMPT
from pcr_rag.bench.reorder import PrefixSet, best_order, order_trace
from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.prompt import PromptBuilder


@dataclass(frozen=True)
class Chunk:
    key: bytes
    num_tokens: int
    segment: int


def toy_plan(question: str, documents) -> list[Chunk]:
    """A chained plan: a 5-token head, one 10-token chunk per document (keys chain like the engine's), the
    question."""
    out, parent = [], b"root"

    def add(label: str, n: int, seg: int) -> None:
        nonlocal parent
        parent = hashlib.blake2b(parent + label.encode(), digest_size=8).digest()
        out.append(Chunk(parent, n, seg))

    add("head", 5, 0)
    for i, d in enumerate(documents, start=1):
        add(d, 10, i)
    add(question, 3, len(documents) + 1)
    return out


def test_nothing_cached_keeps_relevance_order():
    seen = PrefixSet()
    assert best_order("q", ["A", "B", "C"], toy_plan, seen)[:2] == ((0, 1, 2), 0)


def test_best_order_follows_the_cached_chain_and_ties_go_to_relevance():
    seen = PrefixSet()
    seen.add(toy_plan("q0", ["A", "B", "C"]))
    perm, matched, _ = best_order("q1", ["B", "A", "C"], toy_plan, seen)
    assert perm == (1, 0, 2) and matched == 30
    perm, matched, _ = best_order("q2", ["C", "B", "A"], toy_plan, seen)
    assert perm == (2, 1, 0) and matched == 30
    perm, matched, _ = best_order("q3", ["X", "A", "Y"], toy_plan, seen)
    assert perm == (1, 0, 2) and matched == 10  # A first, the rest in relevance order
    tie = PrefixSet()
    tie.add(toy_plan("q4", ["A", "C"]))
    tie.add(toy_plan("q5", ["B", "D"]))
    perm, matched, _ = best_order("q6", ["B", "A"], toy_plan, tie)
    assert perm == (0, 1) and matched == 10  # [B, A] and [A, B] both match 10 tokens: relevance order wins
    # the greedy path (beyond the exhaustive limit) finds the same chain here
    assert best_order("q7", ["C", "B", "A"], toy_plan, seen, exhaustive_max=1)[:2] == ((2, 1, 0), 30)


def test_order_trace_reuse_bounds():
    items = [("q0", ["A", "B"]), ("q1", ["B", "A"]), ("q2", ["A", "B"]), ("q3", ["C", "A"])]
    orders, bound = order_trace(items, toy_plan)
    assert orders == [(0, 1), (1, 0), (0, 1), (1, 0)]
    # relevance: q0 0, q1 0 (B first: new chain), q2 20, q3 0 -> 20/80; cache-aware: q1 20, q2 20, q3 10 -> 50/80
    assert bound.relevance == pytest.approx(20 / 80) and bound.cache_aware == pytest.approx(50 / 80)
    assert bound.reordered == 2 and bound.requests == 4 and bound.doc_tokens == 80


def test_offline_plan_is_the_engines_plan(tmp_path):
    """The bench's offline order (PromptBuilder + plan_chunks under its own root) picks the same orders as the
    engine's plan_for: keys differ only by the root, matches do not."""
    from pcr_rag.engine import PCREngine
    from pcr_rag.testing import tiny_model

    model, tokenizer = tiny_model("llama", seed=0)
    docs = {d: f"Document {d}: " + " ".join(f"{d.lower()}{i}" for i in range(40)) for d in "ABCD"}
    items = [("q0", ["A", "B", "C"]), ("q1", ["B", "A", "C"]), ("q2", ["D", "C", "A"]), ("q3", ["C", "A", "B"])]
    texts = [(q, [docs[d] for d in ds]) for q, ds in items]
    builder = PromptBuilder(tokenizer)
    root = namespace_key("elsewhere", "any", 16)

    def offline(question, documents):
        return plan_chunks(root, builder.build_rag(question, documents, SYSTEM_PROMPT).segments, 16)

    with PCREngine(model=model, tokenizer=tokenizer, cache_dir=tmp_path / "kv", chunk_size=16,
                   enable_cache=False) as engine:
        def engine_plan(question, documents):
            return engine.plan_for(question, documents, system=SYSTEM_PROMPT)

        assert order_trace(texts, engine_plan) == order_trace(texts, offline)
    orders, bound = order_trace(texts, offline)
    assert orders[1] == (1, 0, 2) and bound.cache_aware > bound.relevance
