"""What callers hold while they use cached chunks: ``MatchResult`` (a read-only match), ``Lease`` (a pinned
matched prefix) and ``ChunkLayerReader`` (one chunk's layers, pinned until closed).

Pins are what keep chunks from eviction: every object here that holds nodes gives them back exactly once
(``release``/``close`` are idempotent), through the engine's ``release`` callable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from pcr_rag.cache.node import CacheNode
from pcr_rag.cache.payload import VirtualPayload
from pcr_rag.cache.tiers.base import LayerSource, Tier

__all__ = ["ChunkLayerReader", "Lease", "MatchResult", "ReadVerified", "Release"]

T = TypeVar("T")
Release = Callable[[list[CacheNode]], None]
ReadVerified = Callable[[CacheNode, Tier, Callable[[], T]], T]


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a chunk-key chain: matched keys, the fastest tier of each, where each one's bytes
    live, and the tokens covered."""

    keys: tuple[bytes, ...]
    tiers: tuple[Tier, ...]
    locations: tuple[frozenset[Tier], ...]
    num_tokens: int

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class Lease:
    """Pins a matched prefix so nothing in it is evicted while a request uses it. ``release()`` is idempotent; also
    a context manager. ``keys``/``tiers`` (fastest tier at acquire time) are per matched chunk."""

    def __init__(self, nodes: list[CacheNode], tiers: tuple[Tier, ...], release: Release) -> None:
        self._nodes: list[CacheNode] | None = nodes
        self._release = release
        self.keys: tuple[bytes, ...] = tuple(n.key for n in nodes)
        self.tiers = tiers
        self.num_tokens = sum(n.num_tokens for n in nodes)

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def released(self) -> bool:
        return self._nodes is None

    def release(self) -> None:
        nodes, self._nodes = self._nodes, None
        if nodes:
            self._release(nodes)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.num_chunks} chunks {self.num_tokens} tokens {state}>"


class ChunkLayerReader:
    """Reads one chunk's layers from ``tier`` (see ``CacheManager.open_layer_reader``). A layer that fails
    verification drops that tier's copy and raises ``CorruptChunkError``. The chunk is pinned until ``close``."""

    def __init__(
        self, node: CacheNode, tier: Tier, source: LayerSource, read_verified: ReadVerified, release: Release
    ) -> None:
        self.tier = tier
        self._node: CacheNode | None = node
        self._source: LayerSource | None = source
        self._read_verified = read_verified
        self._release = release

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor | VirtualPayload:
        """Layer ``layer`` ``[2, kv_heads, tokens, head_dim]``; into ``out`` (a staging buffer) where it is read
        from storage (a memory copy is returned as a view instead)."""
        node, source = self._node, self._source
        if node is None or source is None:
            raise ValueError("the layer reader is closed")
        return self._read_verified(node, self.tier, lambda: source.read_layer(layer, out))

    def close(self) -> None:
        source, self._source = self._source, None
        node, self._node = self._node, None
        if source is not None:
            source.close()
        if node is not None:
            self._release([node])

    def __enter__(self) -> ChunkLayerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
