"""Fixtures of the cache-engine tests: chunk builders and payload factories (tiny tensors, milliseconds)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import torch

from pcr_rag.cache import ChunkSpec, chunk_key, namespace_key
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore

ROOT = namespace_key("test-model", "float32", 4)


class Chunks:
    """Builds ChunkSpecs by hand: ``child(parent, tokens)`` chains a chunk under ``parent`` (None = the root)."""

    def __init__(self, root: bytes = ROOT, chunk_size: int = 4) -> None:
        self.root = root
        self.chunk_size = chunk_size
        self.tokens: dict[bytes, tuple[int, ...]] = {}

    def child(self, parent: ChunkSpec | None, tokens: Sequence[int]) -> ChunkSpec:
        parent_key = self.root if parent is None else parent.key
        start = 0 if parent is None else parent.end
        key = chunk_key(parent_key, tokens)
        self.tokens[key] = tuple(tokens)
        return ChunkSpec(key, parent_key, start, start + len(tokens), 0, len(tokens) < self.chunk_size)

    def path(self, token_runs: Sequence[Sequence[int]]) -> list[ChunkSpec]:
        out: list[ChunkSpec] = []
        for run in token_runs:
            out.append(self.child(out[-1] if out else None, run))
        return out


def payload_for(spec: ChunkSpec, layers: int = 2, heads: int = 1, head_dim: int = 4, dtype=torch.float32):
    """A deterministic payload derived from the key, so any reader can check it byte for byte."""
    gen = torch.Generator().manual_seed(int.from_bytes(spec.key[:8], "little") & 0x7FFFFFFF)
    return torch.randn(layers, 2, heads, spec.num_tokens, head_dim, generator=gen).to(dtype)


@pytest.fixture
def chunks() -> Chunks:
    return Chunks()


@pytest.fixture
def make_payload():
    return payload_for


@pytest.fixture
def fake_pinned(monkeypatch) -> list[int]:
    """No CUDA here: page-locked allocations (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) become
    4096-aligned CPU ones, as the host allocator's are. Yields the byte sizes requested page-locked, in order."""
    real_empty = torch.empty
    requests: list[int] = []

    def empty(*size, pin_memory=False, **kw):
        if not pin_memory:
            return real_empty(*size, **kw)
        t = real_empty(*size, **kw)
        requests.append(t.nbytes)
        raw = real_empty(t.nbytes + 4096, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % 4096
        return raw[skip: skip + t.nbytes].view(t.dtype).view(t.shape)

    def pin(self, *args, **kw):
        out = empty(self.shape, dtype=self.dtype, pin_memory=True)
        return out.copy_(self)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return requests


@pytest.fixture
def store_name():
    """A fresh in-memory remote store's name (``memory://<name>``), forgotten after the test."""
    name = f"store-{uuid.uuid4().hex[:8]}"
    yield name
    MemoryRemoteStore.forget(name)
