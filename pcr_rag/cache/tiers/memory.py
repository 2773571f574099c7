"""``MemoryTier``: a tier whose copies are payload objects in memory (DRAM, or a device such as a GPU).

``place`` makes the copy the tier keeps: for DRAM a CPU tensor (page-locked when ``pin_memory``), for a device
tier a tensor on that device; it runs outside the engine lock. ``store``/``drop`` only file the copy under its
key. Copies are used in place, so reads cannot fail while the copy is held (a missing one raises
``ChunkNotFoundError``). Byte accounting is the payload's ``nbytes``, except in a page-locked host tier, which
charges what PyTorch's caching host allocator reserves for it (`pinned_footprint`). A host tier with a
``buffers`` pool gives every dropped copy to it, so a new chunk's payload can reuse the bytes without fresh page
faults (`BufferPool`).
"""

from __future__ import annotations

import torch

from pcr_rag.cache.buffer_pool import BufferPool
from pcr_rag.cache.errors import ChunkNotFoundError
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.tiers.base import ChunkRef, PayloadLayers, Tier, TierKind, TierRecovery

__all__ = ["MemoryTier", "pinned_footprint"]


def pinned_footprint(nbytes: int) -> int:
    """Bytes of page-locked memory a pinned CPU tensor of ``nbytes`` holds: PyTorch's caching host allocator rounds
    every request up to a power of two (its default ``pinned_max_round_threshold``), so a 5.9 MB SmolLM2 chunk
    locks 8 MiB and a 129-token partial chunk as much as a whole one. A pinned tier charges this, so its budget
    bounds the memory really locked, not the payloads' bytes."""
    return 1 << (int(nbytes) - 1).bit_length() if nbytes > 0 else 0


class MemoryTier:
    """Copies kept as payload objects. ``device`` None means host DRAM."""

    kind = TierKind.MEMORY
    shared = False

    def __init__(
        self, tier: Tier, capacity_bytes: int, *, device: torch.device | None = None, pin_memory: bool = False,
        buffers: BufferPool | None = None,
    ) -> None:
        self.tier = tier
        self.capacity_bytes = int(capacity_bytes)
        self.device = device
        self.pin_memory = pin_memory
        self.buffers = buffers
        self._copies: dict[bytes, Payload] = {}

    def charge(self, chunk: ChunkRef) -> int:
        pinned = self.pin_memory and self.device is None and not chunk.virtual
        return pinned_footprint(chunk.nbytes) if pinned else chunk.nbytes

    def place(self, payload: Payload) -> Payload:
        if isinstance(payload, VirtualPayload):
            return payload
        if self.device is not None:
            return payload if payload.device == self.device else payload.to(self.device)
        host = payload if payload.device.type == "cpu" else payload.to("cpu")
        if self.pin_memory and not host.is_pinned():
            host = host.pin_memory()
        return host

    def store(self, chunk: ChunkRef, payload: Payload) -> None:
        self._copies[chunk.key] = payload

    def get(self, chunk: ChunkRef) -> Payload | None:
        return self._copies.get(chunk.key)

    def read(self, chunk: ChunkRef) -> Payload:
        copy = self._copies.get(chunk.key)
        if copy is None:
            raise ChunkNotFoundError(f"chunk {chunk.key.hex()} is not in {self.tier.value}; recompute it")
        return copy

    def read_layer(self, chunk: ChunkRef, layer: int) -> torch.Tensor | VirtualPayload:
        return self.read(chunk)[layer]

    def open_layers(self, chunk: ChunkRef) -> PayloadLayers:
        return PayloadLayers(self.read(chunk))

    def drop(self, chunk: ChunkRef) -> None:
        copy = self._copies.pop(chunk.key, None)
        if copy is not None and self.buffers is not None:
            self.buffers.give(copy)

    def holds(self, chunk: ChunkRef) -> bool:
        return chunk.key in self._copies

    def recover(self) -> TierRecovery:
        return TierRecovery()  # volatile: nothing survives a restart

    def describe(self) -> str:
        return f"{self.tier.value} memory" + (f" on {self.device}" if self.device is not None else "")

    def close(self) -> None:
        """Nothing to release: copies go with the engine."""
