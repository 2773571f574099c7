"""``CacheNode``: a prefix-tree node with the tier state the residency index keeps for it.

Fields (all mutated under the engine lock):
- ``nbytes`` / ``num_layers``: the payload's size and layer count; ``virtual``: metadata-only (no bytes anywhere);
  ``partial``: fewer tokens than a full chunk; ``tokens_digest``: digest of a partial chunk's tokens (supersede).
- ``resident_mask``: bit ``tier_bit(t)`` set while tier ``t`` holds a copy; ``resident_children``: for each tier,
  how many children have a copy there (0 means the node is one of that tier's eviction leaves), packed
  ``CHILD_COUNT_BITS`` bits per tier into one int (``children_in`` reads one; a list per node would cost ~80
  bytes at millions of nodes).
- ``used_at`` (clock seconds) and ``use_seq`` (unique, increasing): the LRU stamp of the last use.
- ``pins``: leases, loads and reads using the node now: no copy of it is dropped by eviction.
- ``tree_holds``: internal holds that keep the node in the tree (its copies may still be demoted).
- ``writeback``: where its write-back to the storage tier stands; ``removed``: it has left the tree.
- ``tenant``: whom its bytes are charged to in every tier but the shared remote store: the tenant whose request
  computed it (the first to insert it, shared-scope chunks included; later users do not change it), or
  ``UNATTRIBUTED``. Per-tenant quotas (``ResidencyIndex``) count and evict by it.
"""

from __future__ import annotations

from enum import Enum

from pcr_rag.cache.prefix_tree import Node
from pcr_rag.cache.tiers.base import TIER_ORDER, UNATTRIBUTED, Tier, tier_bit

__all__ = [
    "CHILD_COUNT_BITS",
    "CHILD_COUNT_MASK",
    "CacheNode",
    "WriteBackState",
    "child_count_shift",
    "children_in",
    "fastest_tier",
]

CHILD_COUNT_BITS = 32
CHILD_COUNT_MASK = (1 << CHILD_COUNT_BITS) - 1


class WriteBackState(Enum):
    """Where a node's copy to the storage tier stands."""

    NOT_NEEDED = "not-needed"  # stored there already, or there is no storage tier
    QUEUED = "queued"
    WRITING = "writing"
    FAILED = "failed"  # an I/O error (e.g. ENOSPC): the node stays in memory only
    SKIPPED = "skipped"  # no room could be made in the storage tier


_MASKS = range(1 << len(TIER_ORDER))
_MASK_TIERS = [frozenset(t for t in TIER_ORDER if m & tier_bit(t)) for m in _MASKS]
_MASK_FASTEST: list[Tier | None] = [next((t for t in TIER_ORDER if m & tier_bit(t)), None) for m in _MASKS]


def child_count_shift(tier: Tier) -> int:
    """Bit offset of ``tier``'s count in ``CacheNode.resident_children``."""
    return CHILD_COUNT_BITS * tier.index


def children_in(node: CacheNode, tier: Tier) -> int:
    """How many children of ``node`` have a copy in ``tier``."""
    return (node.resident_children >> child_count_shift(tier)) & CHILD_COUNT_MASK


def fastest_tier(mask: int) -> Tier | None:
    """The fastest tier in a residency mask (None for an empty mask)."""
    return _MASK_FASTEST[mask]


class CacheNode(Node):
    """A chunk node with its tier state (see the module docstring)."""

    __slots__ = (
        "nbytes",
        "num_layers",
        "partial",
        "virtual",
        "tokens_digest",
        "resident_mask",
        "resident_children",
        "used_at",
        "use_seq",
        "pins",
        "tree_holds",
        "writeback",
        "removed",
        "tenant",
    )

    def __init__(self, key: bytes, parent: Node, num_tokens: int) -> None:
        super().__init__(key, parent, num_tokens)
        self.nbytes = 0
        self.num_layers = 1
        self.partial = False
        self.virtual = False
        self.tokens_digest: bytes | None = None
        self.resident_mask = 0
        self.resident_children = 0
        self.used_at = 0.0
        self.use_seq = 0
        self.pins = 0
        self.tree_holds = 0
        self.writeback = WriteBackState.NOT_NEEDED
        self.removed = False
        self.tenant = UNATTRIBUTED

    @property
    def parent_key(self) -> bytes:
        return self.parent.key

    @property
    def parent_is_root(self) -> bool:
        return self.parent.is_root

    def tiers(self) -> frozenset[Tier]:
        return _MASK_TIERS[self.resident_mask]

    def fastest(self) -> Tier:
        tier = _MASK_FASTEST[self.resident_mask]
        if tier is None:
            raise AssertionError(f"{self!r} is in no tier")
        return tier
