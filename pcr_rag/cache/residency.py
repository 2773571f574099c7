"""The residency index: which tier holds a copy of which chunk, each tier's byte budget and eviction leaves,
making room, eviction and demotion. No threads and no I/O of its own: the caller holds the engine lock for every
call, and copies are dropped through their tier's ``drop`` (quick; an SSD unlink).

Invariants (``check``):
- a chunk node is in the prefix tree iff at least one tier holds a copy of it; its parent is always in the tree;
- ``budgets[t].used`` is the bytes of the copies tier t holds plus bytes reserved for copies in flight, and never
  exceeds ``budgets[t].capacity`` (a reservation that would is refused);
- ``orders[t]`` is exactly tier t's eviction leaves: nodes with a copy in t and no child with a copy in t;
- eviction takes leaves in the policy's order and never drops a copy of a pinned node; dropping a node's last
  copy removes it from the tree, which is allowed only for childless nodes not held in the tree;
- a memory copy that a pending write-back still needs is not evicted (``Evictability.AFTER_WRITEBACK``): the
  caller may wait for the writer instead (``Room.AFTER_WRITEBACK``);
- ``budgets[t].by_tenant`` splits ``used`` by ``CacheNode.tenant`` (every tier but the shared remote store).

Per-tenant quotas (``quotas``: tier -> bytes, e.g. ``CacheConfig.tenant_dram_bytes``), so one tenant cannot evict
another's working set. A chunk is charged to the tenant whose request computed it (``CacheNode.tenant``: the first
to insert it; shared-scope chunks too, so a tenant streaming shared documents spends its own quota; UNATTRIBUTED,
one more tenant, for chunks of unknown origin). ``make_room(tier, n, tenant)`` in a tier with a quota ``q``:

1. ``tenant``'s charged bytes + n must fit in ``q``: if not, ``tenant``'s own leaves are evicted (policy order,
   then its own demotable interior copies in a memory tier) until they do; if they cannot, the room is refused
   (nothing of anyone else is evicted for it). ``n > q`` is refused at once.
2. then the tier's capacity: ``tenant``'s own leaves go first, and only when none of them can go, anyone's
   (policy order) - which happens only when the tier is over-committed.

Invariant: a tenant's charged bytes in a quota tier never exceed the quota through ``make_room``, so when the
capacity is at least the quota times the number of tenants holding bytes there (the inserting tenant included),
step 2 never needs another tenant's bytes: **no copy is evicted by another tenant's insert or load**. (Recovery
after a restart with a smaller quota trims each tenant to it, own leaves first; a tenant's chunk that is the
parent of another tenant's chunk in that tier is not a leaf and stays until the child goes.) Without quotas,
eviction is the policy's alone, as before.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum

from pcr_rag.cache.budget import TierBudget
from pcr_rag.cache.clock import Clock
from pcr_rag.cache.errors import RemoteError
from pcr_rag.cache.keys import tokens_digest
from pcr_rag.cache.node import CHILD_COUNT_MASK, CacheNode, WriteBackState, child_count_shift, children_in
from pcr_rag.cache.policy import EvictionPolicy, LeafOrder, TenantLeafOrder
from pcr_rag.cache.prefix_tree import Node, PrefixTree
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.tiers.base import (
    TIER_ORDER,
    UNATTRIBUTED,
    ChunkRecord,
    ChunkRef,
    KVTier,
    Tier,
    TierKind,
    tier_bit,
)

__all__ = ["Evictability", "ResidencyIndex", "Room"]

log = logging.getLogger(__name__)


class Evictability(Enum):
    """Whether a tier's copy of a node may be evicted now."""

    KEPT = "kept"  # pinned, or its last copy while the node has children or is held in the tree
    AFTER_WRITEBACK = "after-writeback"  # the memory copy a pending write-back still needs
    NOW = "now"


class Room(Enum):
    """The outcome of ``make_room``."""

    RESERVED = "reserved"  # the bytes are reserved: the caller now owns them
    NO_ROOM = "no-room"
    AFTER_WRITEBACK = "after-writeback"  # room could be made once pending write-backs finish


class ResidencyIndex:
    """Tier residency of every chunk node over the active ``tiers`` (see the module docstring). ``quotas``: the
    per-tenant byte quota of a tier (tiers not named have none)."""

    def __init__(
        self, tiers: Sequence[KVTier], policy: EvictionPolicy, clock: Clock, stats: CacheStats,
        quotas: Mapping[Tier, int] | None = None,
    ) -> None:
        self.tree = PrefixTree(self._new_node)
        self.get: Callable[[bytes], CacheNode | None] = self.tree.index.get  # type: ignore[assignment]  # key -> node
        self.policy = policy
        self.clock = clock
        self.stats = stats
        self.tiers: dict[Tier, KVTier] = {t.tier: t for t in tiers}
        self.budgets = {
            t: TierBudget(t, self.tiers[t].capacity_bytes if t in self.tiers else 0,
                          per_tenant=not getattr(self.tiers.get(t), "shared", False))
            for t in TIER_ORDER
        }
        self.quotas: dict[Tier, int] = {}
        for t, q in (quotas or {}).items():
            if q is None:
                continue
            if int(q) <= 0:
                raise ValueError(f"the per-tenant quota of {Tier(t).value} must be > 0 bytes, got {q}")
            if not self.budgets[Tier(t)].per_tenant:
                raise ValueError(f"the {Tier(t).value} tier is shared by replicas: it takes no per-tenant quota")
            self.quotas[Tier(t)] = int(q)
        # a tier with a quota keeps its leaves per tenant too: a tenant's own leaves are found without a walk
        self.orders = {t: TenantLeafOrder() if t in self.quotas else LeafOrder() for t in TIER_ORDER}
        self.protected: frozenset[bytes] = frozenset()
        self.pinned = 0  # nodes with pins > 0 (removed ones included until unpinned)
        self._leaf_orders = [(tier_bit(t), self.orders[t]) for t in TIER_ORDER]
        self._seq = itertools.count(1)
        self._memory = frozenset(t.tier for t in tiers if t.kind is TierKind.MEMORY)
        self._memory_bits = sum(tier_bit(t) for t in self._memory)
        self._storage_bits = sum(tier_bit(t.tier) for t in tiers if t.kind is TierKind.STORAGE)
        self._slower_bits = {t: sum(tier_bit(s) for s in TIER_ORDER[t.index + 1 :]) for t in TIER_ORDER}
        self._child_shift = {t: child_count_shift(t) for t in TIER_ORDER}

    # ------------------------------------------------------------------ nodes
    def _new_node(self, key: bytes, parent: Node, num_tokens: int) -> CacheNode:
        node = CacheNode(key, parent, num_tokens)
        node.used_at = self.clock.now()
        node.use_seq = next(self._seq)  # unique from birth: LRU heap entries never tie
        return node

    def add_node(self, chunk: ChunkRef | ChunkRecord) -> CacheNode:
        """A new node for ``chunk`` in no tier yet (its parent must be a root or in the tree)."""
        node = self.tree.add(chunk.key, chunk.parent_key, chunk.parent_is_root, chunk.num_tokens)
        assert isinstance(node, CacheNode)
        node.nbytes = chunk.nbytes
        node.num_layers = chunk.num_layers
        node.partial = chunk.partial
        node.virtual = chunk.virtual
        node.tokens_digest = chunk.tokens_digest
        node.tenant = chunk.tenant
        return node

    def touch(self, node: CacheNode) -> None:
        node.used_at = self.clock.now()
        node.use_seq = next(self._seq)
        mask = node.resident_mask
        if mask:
            for bit, order in self._leaf_orders:
                if mask & bit:
                    order.touched(node)

    # ------------------------------------------------------------------ pins (the one place they are counted)
    def pin(self, node: CacheNode) -> None:
        node.pins += 1
        if node.pins == 1:
            self.pinned += 1

    def unpin(self, nodes: Iterable[CacheNode]) -> None:
        for n in nodes:
            if n.pins <= 0:
                raise AssertionError(f"unpinning {n!r} that is not pinned")
            n.pins -= 1
            if n.pins == 0:
                self.pinned -= 1

    def pin_and_touch(self, nodes: Sequence[CacheNode]) -> None:
        """Pin and LRU-touch a matched path, root to leaf (the acquire hot path: ``pin`` and ``touch`` inlined)."""
        now = self.clock.now()
        seq = self._seq
        orders = self._leaf_orders
        for n in nodes:
            n.pins += 1
            if n.pins == 1:
                self.pinned += 1
            n.used_at = now
            n.use_seq = next(seq)
            mask = n.resident_mask
            for bit, order in orders:
                if mask & bit:
                    order.touched(n)

    # ------------------------------------------------------------------ copies
    def mark_resident(self, node: CacheNode, tier: Tier) -> None:
        """Record that ``tier`` now holds a copy of ``node`` (its bytes were reserved by ``make_room``)."""
        bit = tier_bit(tier)
        assert not node.resident_mask & bit
        shift = self._child_shift[tier]
        node.resident_mask |= bit
        self.budgets[tier].chunks += 1
        if not (node.resident_children >> shift) & CHILD_COUNT_MASK:
            self.orders[tier].add(node)
        parent = node.parent
        if not parent.is_root:
            assert isinstance(parent, CacheNode)
            parent.resident_children += 1 << shift
            if (parent.resident_children >> shift) & CHILD_COUNT_MASK == 1:
                self.orders[tier].discard(parent)

    def drop_copy(self, node: CacheNode, tier: Tier) -> None:
        """Drop ``tier``'s copy of ``node`` (through the tier) and release its bytes; the node stays in the tree."""
        bit = tier_bit(tier)
        assert node.resident_mask & bit
        shift = self._child_shift[tier]
        node.resident_mask &= ~bit
        budget = self.budgets[tier]
        store = self.tiers[tier]
        budget.chunks -= 1
        budget.release(store.charge(node), node.tenant)
        self.orders[tier].discard(node)
        store.drop(node)
        parent = node.parent
        if not parent.is_root:
            assert isinstance(parent, CacheNode)
            parent.resident_children -= 1 << shift
            if not (parent.resident_children >> shift) & CHILD_COUNT_MASK and parent.resident_mask & bit:
                self.orders[tier].add(parent)

    def _remove(self, node: CacheNode) -> None:
        assert node.resident_mask == 0 and not node.children
        self.tree.remove(node)
        node.removed = True

    def drop_everywhere(self, node: CacheNode) -> None:
        """Remove a childless node from every tier and the tree."""
        for t in node.tiers():
            self.drop_copy(node, t)
        self._remove(node)

    def drop_bad_copy(self, node: CacheNode, tier: Tier, exc: BaseException) -> None:
        """A read of ``tier``'s copy failed verification or I/O: drop that copy and count it (in
        ``corrupt_chunks_dropped``, except remote misses and outages, which the remote tier counts). A node left in
        no tier is removed with its subtree (its descendants are unreachable without it)."""
        if node.removed or not node.resident_mask & tier_bit(tier):
            return
        if isinstance(exc, RemoteError):  # a miss or an unreachable store: counted by the remote tier itself
            log.debug("dropping %s copy of chunk %s: %s", tier.value, node.key.hex(), exc)
        else:
            log.warning("dropping %s chunk %s: %s", tier.value, node.key.hex(), exc)
            self.stats.corrupt_chunks_dropped += 1
        self.drop_copy(node, tier)
        if node.resident_mask == 0:
            for n in self.tree.subtree_postorder(node):
                assert isinstance(n, CacheNode)
                self.drop_everywhere(n)

    # ------------------------------------------------------------------ eviction
    def evictability(self, node: CacheNode, tier: Tier) -> Evictability:
        if node.pins:
            return Evictability.KEPT
        bit = tier_bit(tier)
        mask = node.resident_mask
        if tier in self._memory and not mask & self._storage_bits:
            wb = node.writeback
            # the write-back reads a memory copy: the last one stays until it is written
            if wb is WriteBackState.WRITING or (
                wb is WriteBackState.QUEUED and not mask & self._memory_bits & ~bit
            ):
                return Evictability.AFTER_WRITEBACK
        if mask & ~bit:
            return Evictability.NOW  # a copy stays elsewhere: the tree does not change
        # dropping the last copy removes the node from the tree: only for childless, unheld nodes
        return Evictability.NOW if not node.children and not node.tree_holds else Evictability.KEPT

    def _evict_one(self, node: CacheNode, tier: Tier) -> None:
        self.drop_copy(node, tier)
        self.stats.evictions[tier.value] += 1
        if node.resident_mask & self._slower_bits[tier]:
            self.stats.demotions[tier.value] += 1
        if node.resident_mask == 0:
            self._remove(node)

    def evict(self, tier: Tier, nbytes: int) -> int:
        """Evict from ``tier`` by policy until ``nbytes`` are freed or no candidate is left; returns bytes freed."""
        budget = self.budgets[tier]
        before = budget.used
        self._evict_pass(tier, lambda: before - budget.used >= nbytes)
        return before - budget.used

    def _evict_pass(self, tier: Tier, done: Callable[[], bool], owner: bytes | None = None) -> tuple[bool, bool]:
        """Evict candidates (only ``owner``'s when given) until ``done()``; returns (done, whether a copy was passed
        over for a write-back)."""
        if done():
            return True, False
        waits_for_writeback = False
        order = self.orders[tier]
        if owner is not None and isinstance(order, TenantLeafOrder):
            order = order.of(owner)  # the owner's leaves only; evicting one discards it from both orders
        gen = self.policy.candidates(order, self.protected)
        try:
            for node in gen:
                if owner is not None and node.tenant != owner:
                    continue  # another tenant's leaf (a tier without quotas): the generator restores it
                verdict = self.evictability(node, tier)
                if verdict is Evictability.AFTER_WRITEBACK:
                    waits_for_writeback = True
                elif verdict is Evictability.NOW:
                    self._evict_one(node, tier)
                    if done():
                        return True, waits_for_writeback
        finally:
            gen.close()
        if tier in self._memory:
            self._demote_interior(tier, done, owner)
        return done(), waits_for_writeback

    def _demote_interior(self, tier: Tier, done: Callable[[], bool], owner: bytes | None = None) -> None:
        """Fallback when no leaf of a memory tier can go (e.g. a long chain fills DRAM and its only leaf is the
        pinned parent of the chunk being inserted): drop memory copies of non-leaf nodes that also live in a slower
        tier, least recent first (unprotected first under look-ahead). The tree does not change (pure demotion).
        O(nodes log nodes), so it runs only after the leaf pass failed."""
        bit = tier_bit(tier)
        slower = self._slower_bits[tier]
        protected = self.protected if self.policy.uses_lookahead else frozenset()

        def movable(n: CacheNode) -> bool:
            return (bool(n.resident_mask & bit and n.resident_mask & slower) and not n.pins
                    and (owner is None or n.tenant == owner))

        candidates = [n for n in self.tree.iter_nodes() if movable(n)]  # type: ignore[arg-type]
        candidates.sort(key=lambda n: (n.key in protected, n.used_at, n.use_seq))  # type: ignore[attr-defined]
        for node in candidates:
            assert isinstance(node, CacheNode)
            if movable(node):
                self._evict_one(node, tier)
                if done():
                    return

    def make_room(self, tier: Tier, nbytes: int, tenant: bytes = UNATTRIBUTED) -> Room:
        """Reserve ``nbytes`` in ``tier`` for ``tenant``, evicting as needed (never waits): by policy, or, in a tier
        with a per-tenant quota, by the quota rules of the module docstring."""
        budget = self.budgets[tier]
        quota = self.quotas.get(tier)
        if quota is None:
            if budget.reserve(nbytes, tenant):
                return Room.RESERVED
            if nbytes > budget.capacity:
                return Room.NO_ROOM
            done, waits = self._evict_pass(tier, lambda: budget.free >= nbytes)
        else:
            if nbytes > min(quota, budget.capacity):
                return Room.NO_ROOM
            done, waits = self._evict_pass(tier, lambda: budget.owned(tenant) + nbytes <= quota, tenant)
            if not done:
                self.stats.quota_refusals[tier.value] += 1
                return Room.AFTER_WRITEBACK if waits else Room.NO_ROOM
            if budget.reserve(nbytes, tenant):
                return Room.RESERVED
            done, waits = self._evict_pass(tier, lambda: budget.free >= nbytes, tenant)
            if not done:
                done, waits_any = self._evict_pass(tier, lambda: budget.free >= nbytes)
                waits = waits or waits_any
        if done:
            budget.reserve(nbytes, tenant)
            return Room.RESERVED
        return Room.AFTER_WRITEBACK if waits else Room.NO_ROOM

    def trim_to_quota(self, tier: Tier) -> None:
        """Evict each tenant's own leaves until it is within ``tier``'s quota (restart recovery, when the quota
        shrank or the directory held more; a tenant whose bytes cannot go, e.g. a parent of another tenant's
        chunk, stays over until they can)."""
        quota = self.quotas.get(tier)
        if quota is None:
            return
        budget = self.budgets[tier]
        for tenant in [t for t, n in budget.by_tenant.items() if n > quota]:
            self._evict_pass(tier, lambda t=tenant: budget.owned(t) <= quota, tenant)  # type: ignore[misc]

    def inserted(self, node: CacheNode, tokens: Sequence[int] | None) -> None:
        """Count a new chunk; a full one given its ``tokens`` supersedes partial siblings it extends."""
        self.stats.inserts += 1
        if tokens is not None and not node.partial:
            self.supersede_partial_siblings(node, tokens)

    def release(self, tier: Tier, nbytes: int, tenant: bytes = UNATTRIBUTED) -> None:
        """Give back bytes reserved by ``make_room`` (for ``tenant``) and not used."""
        self.budgets[tier].release(nbytes, tenant)

    # ------------------------------------------------------------------ inserts
    def supersede_partial_siblings(self, node: CacheNode, tokens: Sequence[int]) -> None:
        """A full chunk whose tokens start with a partial leaf sibling's tokens replaces it: the sibling is dropped,
        or, while in use, moved to the front of every eviction order."""
        for sib in list(node.parent.children or ()):
            if sib is node or not isinstance(sib, CacheNode) or not sib.partial or sib.children:
                continue
            if sib.tokens_digest is None or sib.num_tokens >= len(tokens):
                continue
            if tokens_digest(tokens[: sib.num_tokens]) != sib.tokens_digest:
                continue
            self.stats.superseded += 1
            if sib.pins == 0 and sib.tree_holds == 0 and sib.writeback is not WriteBackState.WRITING:
                self.drop_everywhere(sib)
            else:
                sib.used_at = float("-inf")
                sib.use_seq = next(self._seq)
                for order in self.orders.values():
                    order.touched(sib)

    # ------------------------------------------------------------------ checks
    def check(self, quiet: bool) -> None:
        """Assert every structural and accounting invariant (O(nodes)). Exact byte equality only when ``quiet``
        (no transfer in flight holds a reservation)."""
        self.tree.check()
        counts = [0] * len(TIER_ORDER)
        used = [0] * len(TIER_ORDER)
        owned: list[dict[bytes, int]] = [{} for _ in TIER_ORDER]
        for node in self.tree.iter_nodes():
            assert isinstance(node, CacheNode)
            assert not node.removed
            assert node.resident_mask, f"{node!r} is in the tree but in no tier"
            for i, t in enumerate(TIER_ORDER):
                bit = tier_bit(t)
                res = bool(node.resident_mask & bit)
                store = self.tiers.get(t)
                if res:
                    assert store is not None, f"{node!r} is resident in the inactive tier {t.value}"
                    counts[i] += 1
                    used[i] += store.charge(node)
                    owned[i][node.tenant] = owned[i].get(node.tenant, 0) + store.charge(node)
                if store is not None and not (node.virtual and store.kind is TierKind.STORAGE):
                    assert store.holds(node) == res, (
                        f"{t.value} copy of {node!r} disagrees with its residency"
                    )
                n_child = sum(1 for c in node.children or () if c.resident_mask & bit)  # type: ignore[attr-defined]
                assert children_in(node, t) == n_child, f"child count of {node!r} in {t.value} is wrong"
                assert (node in self.orders[t]) == (res and n_child == 0), (
                    f"{t.value} leaf set wrong for {node!r}"
                )
                order = self.orders[t]
                if isinstance(order, TenantLeafOrder):
                    assert (node in order.of(node.tenant)) == (node in order), (
                        f"{t.value} per-tenant leaf set wrong for {node!r}")
            assert node.pins >= 0
        pinned_live = sum(1 for n in self.tree.iter_nodes() if n.pins)  # type: ignore[attr-defined]
        assert pinned_live <= self.pinned, f"pinned count {self.pinned} < {pinned_live} pinned nodes"
        for i, t in enumerate(TIER_ORDER):
            b = self.budgets[t]
            assert b.chunks == counts[i], f"{t.value} chunk count {b.chunks} != {counts[i]}"
            assert 0 <= b.used <= b.capacity, f"{t.value} over budget: {b.used} > {b.capacity}"
            assert b.high_water <= b.capacity
            leaves = [
                n for n in self.tree.iter_nodes() if n.resident_mask & tier_bit(t) and not children_in(n, t)
            ]  # type: ignore[attr-defined,arg-type]
            assert len(self.orders[t]) == len(leaves), f"{t.value} leaf set has {len(self.orders[t])} nodes"
            order = self.orders[t]
            if isinstance(order, TenantLeafOrder):
                assert sum(len(sub) for sub in order.by_tenant.values()) == len(order), (
                    f"{t.value} per-tenant leaf sets do not partition its leaves")
            if b.per_tenant:
                assert all(n > 0 for n in b.by_tenant.values()), f"{t.value} per-tenant bytes not positive"
                assert sum(b.by_tenant.values()) == b.used, f"{t.value} per-tenant bytes do not sum to used"
            if quiet:
                assert b.used == used[i], f"{t.value} bytes used {b.used} != stored {used[i]}"
                if b.per_tenant:
                    assert b.by_tenant == {k: n for k, n in owned[i].items() if n}, (
                        f"{t.value} per-tenant bytes disagree with the nodes' tenants")
