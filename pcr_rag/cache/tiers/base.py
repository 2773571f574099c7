"""Tiers (fastest first) and the one interface every tier implements.

A tier holds *copies* of chunk payloads. The cache engine decides which tier holds what (``residency``); a tier
only stores, reads and forgets copies. Two kinds:

- ``TierKind.MEMORY`` (device, DRAM): a copy is a payload object usable in place. ``store``/``drop`` are
  metadata only (run under the engine lock, never fail); ``place`` moves a payload into the tier's memory (a
  device or pinned copy) and runs outside the lock.
- ``TierKind.STORAGE`` (SSD, the remote store): a copy must be read, and verified, before use. ``store`` and the
  reads do I/O outside the engine lock and may fail; ``drop`` runs under the lock. A *shared* storage tier (the
  remote store: ``shared = True``) holds copies other engines wrote too: its ``drop`` only forgets the copy
  locally, ``recover`` lists nothing (the engine learns its chunks by lookups), and the store may evict a value
  at any time (a read then fails as a miss).

The contract a tier must keep (the engine relies on it, tests check it through the engine):

- **Byte budget.** ``capacity_bytes`` is the tier's budget; a copy of a chunk costs ``charge(chunk)`` bytes (what
  it really occupies there: a storage tier includes its headers and padding). The engine reserves those bytes
  before ``store`` and never lets the sum exceed the capacity; the tier does no accounting of its own.
- **Verification on read.** What ``read``/``read_layer``/``open_layers`` hand back is byte-exact what ``store`` was
  given for that key, or they raise. A storage tier checks its copies (header, key, sizes, per-layer checksums)
  before returning them.
- **Failure is a miss.** A failed or timed-out read raises ``CorruptChunkError``, ``OSError`` or ``TimeoutError``
  (nothing else); the engine then drops the copy and the caller recomputes. A failed ``store`` raises ``OSError``
  (or ``TimeoutError``) and leaves nothing behind. No call may block without a bound.
- **Metadata-only chunks** (``chunk.virtual``, the simulator) are accounted like real ones, but no bytes move:
  reads return ``VirtualPayload`` s and a storage tier keeps no file for them.
- ``recover()`` lists the copies a persistent tier still holds after a restart (oldest first), having deleted the
  ones that fail verification; a volatile tier returns an empty recovery.

Adding a tier: a ``Tier`` member in speed order, a module implementing ``KVTier``, and one line in
``tiers.build_tiers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

import torch

from pcr_rag.cache.payload import Payload, VirtualPayload

__all__ = [
    "TIER_ORDER",
    "ChunkRecord",
    "ChunkRef",
    "KVTier",
    "LayerSource",
    "PayloadLayers",
    "Tier",
    "TierKind",
    "TierRecovery",
    "UNATTRIBUTED",
    "tier_bit",
]

#: The tenant of a chunk no tenant is known for (a remote chunk found by a lookup, a chunk file written before
#: tenants were recorded): bytes charged to it form one more tenant's share (``CacheNode.tenant``).
UNATTRIBUTED = b""


class Tier(str, Enum):
    """A tier of the cache, in speed order (fastest first). Compare members directly (``t is Tier.SSD``)."""

    DEVICE = "device"
    DRAM = "dram"
    SSD = "ssd"
    REMOTE = "remote"  # a store shared by replicas (Valkey/Redis), below SSD

    # the value's hash, in C: Enum's own __hash__ is Python code, and tiers key the dicts of every insert and
    # eviction (consistent with equality: a member equals its value string)
    __hash__ = str.__hash__

    @property
    def index(self) -> int:
        return _INDEX[self]


TIER_ORDER: tuple[Tier, ...] = tuple(Tier)
_INDEX = {t: i for i, t in enumerate(TIER_ORDER)}


def tier_bit(tier: Tier) -> int:
    """Bit of ``tier`` in a node's residency mask."""
    return 1 << _INDEX[tier]


class TierKind(Enum):
    MEMORY = "memory"  # copies are payload objects, used in place
    STORAGE = "storage"  # copies are read (and verified) before use


class ChunkRef(Protocol):
    """What a tier may know about a chunk (a cache node satisfies it)."""

    key: bytes
    num_tokens: int
    partial: bool
    virtual: bool
    nbytes: int
    num_layers: int
    tokens_digest: bytes | None
    tenant: bytes

    @property
    def parent_key(self) -> bytes: ...

    @property
    def parent_is_root(self) -> bool: ...


class ChunkRecord(NamedTuple):
    """A chunk that has no cache node (yet): one being inserted or written through, or one a tier recovered.
    ``charged_bytes`` is what the recovering tier's budget is charged for it (0 when not from a tier); ``tenant``
    whom its bytes are charged to (`UNATTRIBUTED` when unknown). A named tuple: immutable and cheap to build on
    the insert path."""

    key: bytes
    parent_key: bytes
    parent_is_root: bool
    num_tokens: int
    partial: bool
    tokens_digest: bytes | None
    nbytes: int
    num_layers: int
    virtual: bool = False
    charged_bytes: int = 0
    tenant: bytes = UNATTRIBUTED


@dataclass(frozen=True)
class TierRecovery:
    """What a tier holds at start-up: valid chunks, oldest write first, and how many bad copies it deleted."""

    chunks: tuple[ChunkRecord, ...] = ()
    corrupt: int = 0


class LayerSource(Protocol):
    """One chunk opened for layer-by-layer reads (verified per layer). Not thread-safe; close it when done."""

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor | VirtualPayload: ...

    def close(self) -> None: ...


class PayloadLayers:
    """A ``LayerSource`` over a payload object (a memory copy, or a metadata-only chunk): layers are views."""

    def __init__(self, payload: Payload) -> None:
        self._payload = payload

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor | VirtualPayload:
        return self._payload[layer]

    def close(self) -> None:
        """Nothing to release."""


class KVTier(Protocol):
    """One tier of chunk copies. See the module docstring for the contract."""

    tier: Tier
    kind: TierKind
    capacity_bytes: int
    shared: bool  # copies live in a store other engines use too (see the module docstring)

    def charge(self, chunk: ChunkRef) -> int:
        """Bytes a copy of ``chunk`` occupies in this tier."""
        ...

    def place(self, payload: Payload) -> Payload:
        """``payload`` as this tier keeps or writes it (memory tiers copy it to their device; no lock held)."""
        ...

    def store(self, chunk: ChunkRef, payload: Payload) -> None:
        """Keep a copy of ``payload`` for ``chunk`` (a placed payload)."""
        ...

    def get(self, chunk: ChunkRef) -> Payload | None:
        """The copy when it is usable in place (memory tiers), else None (no I/O)."""
        ...

    def read(self, chunk: ChunkRef) -> Payload:
        """The whole payload, verified."""
        ...

    def read_layer(self, chunk: ChunkRef, layer: int) -> torch.Tensor | VirtualPayload:
        """Layer ``layer`` ``[2, kv_heads, tokens, head_dim]``, verified; a storage tier reads only that layer."""
        ...

    def open_layers(self, chunk: ChunkRef) -> LayerSource:
        """Open ``chunk`` once (a storage tier verifies its header once) to read its layers one by one."""
        ...

    def drop(self, chunk: ChunkRef) -> None:
        """Forget the copy (called under the engine lock; quick)."""
        ...

    def holds(self, chunk: ChunkRef) -> bool:
        """Whether a copy is stored (invariant checks)."""
        ...

    def recover(self) -> TierRecovery: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...
