"""Eviction order: per-tier explicit leaf sets kept in LRU order, and the LRU / look-ahead LRU policies.

A ``LeafOrder`` holds the leaves of one tier (resident nodes with no child resident in that tier) and a lazy
min-heap over ``(node.used_at, node.use_seq)``: touching a node pushes a fresh entry, stale entries are skipped when
popped, and the heap is rebuilt when it grows past twice the leaf count. ``node.use_seq`` is a unique, increasing
stamp set by the engine on every touch, so the order is strict and deterministic even under a frozen clock.

Policies only *order* candidates; the engine decides eligibility (pinned, write-back pending, ...) and stops when
enough bytes are free. ``LookaheadLRUPolicy`` is the paper's look-ahead update: chunks the waiting window needs
(the protected set) are offered only after every unprotected leaf, oldest first in both groups.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator
from typing import Any

__all__ = ["EvictionPolicy", "LRUPolicy", "LeafOrder", "LookaheadLRUPolicy", "TenantLeafOrder", "make_policy"]


class LeafOrder:
    """Leaves of one tier in least-recently-used order (see module docstring)."""

    def __init__(self) -> None:
        self.leaves: set[Any] = set()
        self._heap: list[tuple[float, int, Any]] = []
        self._iterating = 0

    def __len__(self) -> int:
        return len(self.leaves)

    def __contains__(self, node: object) -> bool:
        return node in self.leaves

    def add(self, node: Any) -> None:
        if node not in self.leaves:
            self.leaves.add(node)
            self._push(node)

    def discard(self, node: Any) -> None:
        self.leaves.discard(node)  # its heap entries become stale

    def touched(self, node: Any) -> None:
        """Call after ``node.used_at``/``node.use_seq`` changed."""
        if node in self.leaves:
            self._push(node)

    def _push(self, node: Any) -> None:
        heapq.heappush(self._heap, (node.used_at, node.use_seq, node))
        if not self._iterating and len(self._heap) > 2 * len(self.leaves) + 256:
            self._heap = [(n.used_at, n.use_seq, n) for n in self.leaves]
            heapq.heapify(self._heap)

    def pop_oldest(self) -> Any | None:
        """Remove and return the least recent leaf from the heap (it stays in ``leaves``); the caller must
        either ``discard`` it or ``push_back`` it."""
        heap = self._heap
        while heap:
            used_at, use_seq, node = heapq.heappop(heap)
            if node.use_seq == use_seq and node.used_at == used_at and node in self.leaves:
                return node
        return None

    def push_back(self, node: Any) -> None:
        if node in self.leaves:
            heapq.heappush(self._heap, (node.used_at, node.use_seq, node))

    def ordered(self) -> list[Any]:
        """All leaves, least recent first (O(n log n); tests and debugging)."""
        return sorted(self.leaves, key=lambda n: (n.used_at, n.use_seq))


class TenantLeafOrder(LeafOrder):
    """A ``LeafOrder`` that also keeps one ``LeafOrder`` per tenant (``node.tenant``) of the same leaves, so a
    tier with per-tenant quotas evicts one tenant's leaves in LRU order without walking the others'
    (``of(tenant)``). Invariant: ``leaves`` is the disjoint union of the sub-orders' leaves, each node in its
    tenant's; a sub-order left empty is dropped unless a pass is iterating over it."""

    def __init__(self) -> None:
        super().__init__()
        self.by_tenant: dict[bytes, LeafOrder] = {}

    def of(self, tenant: bytes) -> LeafOrder:
        """The leaves of ``tenant`` (an empty order when it has none)."""
        return self.by_tenant.get(tenant) or LeafOrder()

    def add(self, node: Any) -> None:
        super().add(node)
        sub = self.by_tenant.get(node.tenant)
        if sub is None:
            sub = self.by_tenant[node.tenant] = LeafOrder()
        sub.add(node)

    def discard(self, node: Any) -> None:
        super().discard(node)
        sub = self.by_tenant.get(node.tenant)
        if sub is not None:
            sub.discard(node)
            if not sub.leaves and not sub._iterating:
                del self.by_tenant[node.tenant]

    def touched(self, node: Any) -> None:
        super().touched(node)
        sub = self.by_tenant.get(node.tenant)
        if sub is not None:
            sub.touched(node)


class EvictionPolicy:
    """Orders eviction candidates of one tier. ``candidates`` is a generator: after each yielded node the engine
    either evicts it (removing it from the tier's leaves) or leaves it; nodes left are restored to the order when
    the generator finishes or is closed."""

    name = "lru"
    uses_lookahead = False

    def candidates(self, order: LeafOrder, protected: Container[bytes]) -> Iterator[Any]:
        aside: list[Any] = []
        later: list[Any] = []
        order._iterating += 1
        try:
            while True:
                node = order.pop_oldest()
                if node is None:
                    break
                if self.uses_lookahead and node.key in protected:
                    later.append(node)
                    continue
                aside.append(node)
                yield node
            for node in later:
                if node in order.leaves:
                    yield node
        finally:
            order._iterating -= 1
            seen: set[int] = set()
            for node in aside + later:
                if id(node) not in seen:
                    seen.add(id(node))
                    order.push_back(node)


class LRUPolicy(EvictionPolicy):
    """Plain LRU over the tier's leaves (the look-ahead protection is ignored)."""

    name = "lru"
    uses_lookahead = False


class LookaheadLRUPolicy(EvictionPolicy):
    """LRU that evicts protected (soon needed) leaves only after all unprotected ones."""

    name = "lookahead-lru"
    uses_lookahead = True


def make_policy(name: str) -> EvictionPolicy:
    policies: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lookahead-lru": LookaheadLRUPolicy}
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(policies)}") from None
