"""Chunk keys: chained blake2b-128 hashes over a namespace root, and the per-segment chunk plan of a prompt.

Invariants:
- ``namespace_key`` covers model fingerprint, dtype, chunk size and tenant salt, so nothing crosses models/tenants.
- ``chunk_key(parent, tokens)`` hashes the parent key, the token ids (little-endian int64) and the token count, so a
  key covers its own tokens and every token before it; equal keys mean equal KV. A partial chunk and a full chunk
  with the same parent never share a key (the count differs).
- Python's salted ``hash()`` is never used: keys are stable across processes and restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KEY_BYTES", "ChunkSpec", "chunk_key", "namespace_key", "plan_chunks", "tokens_digest"]

KEY_BYTES = 16
_NS_PERSON = b"pcr-ns-v1"
_CHUNK_PERSON = b"pcr-chunk-v1"
_DIGEST_PERSON = b"pcr-tok-v1"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype="<i8")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    return arr.tobytes()


def namespace_key(model_fingerprint: str, dtype: str, chunk_size: int, salt: str = "") -> bytes:
    """16-byte root key of a cache namespace (model identity, KV dtype, chunk size in tokens, tenant salt)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 tokens, got {chunk_size}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_NS_PERSON)
    for part in (model_fingerprint, str(dtype), str(int(chunk_size)), salt):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


def chunk_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """16-byte key of a chunk: blake2b(parent key || tokens as int64 LE || token count as uint64 LE)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    raw = _token_bytes(tokens)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_CHUNK_PERSON)
    h.update(parent)
    h.update(raw)
    h.update((len(raw) // 8).to_bytes(8, "little"))
    return h.digest()


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """16-byte digest of a token run alone (no parent): used to tell whether a partial chunk's tokens are a
    prefix of a full sibling's tokens (the cache's "supersede" rule)."""
    raw = _token_bytes(tokens)
    return hashlib.blake2b(raw, digest_size=KEY_BYTES, person=_DIGEST_PERSON).digest()


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a prompt's plan. ``[start, end)`` are prompt token offsets; ``segment`` indexes the
    prompt's segments; ``partial`` is True when the chunk holds fewer than ``chunk_size`` tokens (the tail of a
    segment). ``start == 0`` means ``parent`` is the namespace root key."""

    key: bytes
    parent: bytes
    start: int
    end: int
    segment: int
    partial: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def plan_chunks(root: bytes, segments: Sequence[Sequence[int]], chunk_size: int) -> list[ChunkSpec]:
    """Cut each segment on its own into ``chunk_size``-token chunks (the last one of a segment may be partial)
    and chain their keys from ``root`` across segments. Empty segments contribute no chunk."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 tokens, got {chunk_size}")
    if len(root) != KEY_BYTES:
        raise ValueError(f"root key must be {KEY_BYTES} bytes, got {len(root)}")
    specs: list[ChunkSpec] = []
    parent = root
    offset = 0
    for seg_index, segment in enumerate(segments):
        seg = np.asarray(segment, dtype="<i8")
        if seg.ndim != 1:
            raise ValueError(f"segment {seg_index} must be a flat sequence of token ids, got shape {seg.shape}")
        n = int(seg.shape[0])
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            key = chunk_key(parent, seg[lo:hi])
            specs.append(
                ChunkSpec(
                    key=key,
                    parent=parent,
                    start=offset + lo,
                    end=offset + hi,
                    segment=seg_index,
                    partial=(hi - lo) < chunk_size,
                )
            )
            parent = key
        offset += n
    return specs
