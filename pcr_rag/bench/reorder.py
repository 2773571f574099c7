"""Cache-aware document order, offline, and the reuse bound of a trace in either order.

Chunk keys chain across documents, so a prefix cache reuses a request's documents only up to the first one
whose chunk chain differs from what was served before. Real retrieval returns overlapping lists in different
orders; serving the documents in the order whose chunk chain matches the longest cached prefix (relevance order
breaking ties) recovers that reuse, at the price of a different prompt.

The engine's `PCREngine.order_for_reuse(documents)` does this against its live cache; where the engine has no
such method the benchmark uses `order_trace` here instead: it walks a trace in service order against an
*unbounded* cache (the set of chunk keys seen so far), picks each request's best order, and returns the reuse
bound of the trace served in relevance order and in cache-aware order: the fraction of document tokens a cache
that never evicts would reuse.

``plan`` is any ``(question, document texts) -> chunk plan`` function returning objects with ``key``,
``num_tokens`` and ``segment`` (`pcr_rag.cache.keys.ChunkSpec`), e.g. ``PCREngine.plan_for`` with the bench's
system prompt, or the same computation without an engine (`pcr_rag.bench.traces`). Segment 0 is the shared
prompt head, segments ``1..k`` the ``k`` documents, the rest the question.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EXHAUSTIVE_MAX_DOCS", "PlanFn", "PrefixSet", "ReuseBound", "best_order", "order_trace"]

PlanFn = Callable[[str, Sequence[str]], Sequence[Any]]
#: Up to this many documents every order is tried (5! = 120 plans); beyond it the order is built greedily.
EXHAUSTIVE_MAX_DOCS = 5


class PrefixSet:
    """The chunk keys served so far: an unbounded prefix cache (nothing is ever evicted)."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def matched_doc_tokens(self, plan: Sequence[Any], num_docs: int) -> int:
        """Document tokens (segments ``1..num_docs``) in the plan's longest prefix of known chunks."""
        tokens = 0
        for chunk in plan:
            if chunk.key not in self._keys:
                break
            if 1 <= chunk.segment <= num_docs:
                tokens += chunk.num_tokens
        return tokens

    def add(self, plan: Iterable[Any]) -> None:
        self._keys.update(chunk.key for chunk in plan)


def _doc_tokens(plan: Sequence[Any], num_docs: int) -> int:
    return sum(c.num_tokens for c in plan if 1 <= c.segment <= num_docs)


def best_order(question: str, documents: Sequence[str], plan: PlanFn, seen: PrefixSet, *,
               exhaustive_max: int = EXHAUSTIVE_MAX_DOCS) -> tuple[tuple[int, ...], int, Sequence[Any]]:
    """The order (a permutation of ``range(len(documents))``) whose plan matches the most document tokens of
    ``seen``, the tokens it matches, and its plan. Ties go to relevance order (the lexicographically first
    permutation), so with nothing matched the order is unchanged.

    Up to ``exhaustive_max`` documents every permutation is tried; beyond, position by position the first document
    (in relevance order) that matches the most is appended, and the rest keep relevance order once nothing more
    matches."""
    k = len(documents)
    identity = tuple(range(k))
    base_plan = plan(question, list(documents))
    base = seen.matched_doc_tokens(base_plan, k)
    if base == _doc_tokens(base_plan, k) or k < 2:
        return identity, base, base_plan
    best: tuple[tuple[int, ...], int, Sequence[Any]] = (identity, base, base_plan)
    if k <= exhaustive_max:
        for perm in itertools.permutations(range(k)):
            if perm == identity:
                continue
            p = plan(question, [documents[i] for i in perm])
            m = seen.matched_doc_tokens(p, k)
            if m > best[1]:
                best = (perm, m, p)
        return best
    chosen: list[int] = []
    remaining = list(range(k))
    matched = 0
    while remaining:
        step: tuple[int, int, Sequence[Any]] | None = None
        for i in remaining:
            order = [*chosen, i, *(j for j in remaining if j != i)]
            p = plan(question, [documents[j] for j in order])
            m = seen.matched_doc_tokens(p, k)
            if m > matched and (step is None or m > step[1]):
                step = (i, m, p)
        if step is None:
            break
        chosen.append(step[0])
        remaining.remove(step[0])
        matched = step[1]
    perm = (*chosen, *remaining)
    p = plan(question, [documents[i] for i in perm])
    return perm, seen.matched_doc_tokens(p, k), p


@dataclass(frozen=True)
class ReuseBound:
    """Fractions of a trace's document tokens an unbounded prefix cache reuses, serving each request in
    ``relevance`` order or in ``cache_aware`` order; ``doc_tokens``: document tokens of the trace (relevance
    order), ``reordered``: requests whose cache-aware order differs from relevance order."""

    relevance: float
    cache_aware: float
    doc_tokens: int
    reordered: int
    requests: int

    def as_dict(self) -> dict[str, Any]:
        return {"relevance": self.relevance, "cache_aware": self.cache_aware, "doc_tokens": self.doc_tokens,
                "reordered": self.reordered, "requests": self.requests}


def order_trace(items: Sequence[tuple[str, Sequence[str]]], plan: PlanFn, *,
                exhaustive_max: int = EXHAUSTIVE_MAX_DOCS) -> tuple[list[tuple[int, ...]], ReuseBound]:
    """Walk ``items`` (question, documents in relevance order), in service order, against two unbounded caches:
    one served in relevance order, one in cache-aware order (each request's `best_order` against what that cache
    has seen). Returns the cache-aware permutation of every item and the `ReuseBound` of both."""
    relevance_seen, aware_seen = PrefixSet(), PrefixSet()
    orders: list[tuple[int, ...]] = []
    total = matched_rel = matched_aware = reordered = 0
    for question, docs in items:
        k = len(docs)
        rel_plan = plan(question, list(docs))
        total += _doc_tokens(rel_plan, k)
        matched_rel += relevance_seen.matched_doc_tokens(rel_plan, k)
        relevance_seen.add(rel_plan)
        perm, m, p = best_order(question, docs, plan, aware_seen, exhaustive_max=exhaustive_max)
        matched_aware += m
        aware_seen.add(p)
        orders.append(perm)
        reordered += perm != tuple(range(k))
    bound = ReuseBound(matched_rel / total if total else 0.0, matched_aware / total if total else 0.0, total,
                       reordered, len(items))
    return orders, bound
