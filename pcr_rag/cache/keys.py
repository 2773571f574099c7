"""Chunk keys: chained blake2b-128 hashes over a namespace root, and the per-segment chunk plan of a prompt.

Invariants:
- ``namespace_key`` covers model fingerprint, dtype, chunk size and tenant salt, so nothing crosses models/tenants.
- ``chunk_key(parent, tokens)`` hashes the parent key, the token ids (little-endian int64) and the token count, so a
  key covers its own tokens and every token before it; equal keys mean equal KV. A partial chunk and a full chunk
  with the same parent never share a key (the count differs).
- ``blend_root(root)`` roots the position-independent chains of blend mode: under its own personalization, so
  they never share a key with an exact chain.
- Python's salted ``hash()`` is never used: keys are stable across processes and restarts.
- Sharing scopes (`plan_chunks` with ``private_root``): the chunks of the shared segments chain from the shared
  root; the first private segment's parent is ``scope_key(private_root, last shared key)``, a hash under its own
  personalization, so a chunk at or after a private segment can equal no key computed under another root (only a
  blake2b collision would). A plan without a private segment, or with every segment private and ``private_root``
  as its root, has exactly the keys of the plain chain from that root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KEY_BYTES", "ChunkSpec", "blend_root", "chunk_key", "namespace_key", "plan_chunks", "scope_key", "tokens_digest"]

KEY_BYTES = 16
_NS_PERSON = b"pcr-ns-v1"
_CHUNK_PERSON = b"pcr-chunk-v1"
_DIGEST_PERSON = b"pcr-tok-v1"
_SCOPE_PERSON = b"pcr-scope-v1"
_BLEND_PERSON = b"pcr-blend-v1"


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


def scope_key(private_root: bytes, parent: bytes) -> bytes:
    """16-byte parent of the first chunk of a private segment that follows ``parent`` (the last key of the
    shared chain before it): blake2b(private root || parent) under its own personalization, so it is neither a
    root nor a chunk key and depends on the private (tenant) root."""
    if len(private_root) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError(f"scope_key takes two {KEY_BYTES}-byte keys, got {len(private_root)} and {len(parent)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_SCOPE_PERSON)
    h.update(private_root)
    h.update(parent)
    return h.digest()


def blend_root(root: bytes) -> bytes:
    """16-byte root of ``root``'s position-independent key space (blend mode, `pcr_rag.sched.blend`): the
    chains ``[anchor][document]`` of a namespace's documents chain from it, so they share no key with the exact
    chains from ``root`` and inherit its scope (the engine-wide root's for shared documents, a tenant's for
    private ones)."""
    if len(root) != KEY_BYTES:
        raise ValueError(f"root key must be {KEY_BYTES} bytes, got {len(root)}")
    return hashlib.blake2b(root, digest_size=KEY_BYTES, person=_BLEND_PERSON).digest()


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """16-byte digest of a token run alone (no parent): used to tell whether a partial chunk's tokens are a
    prefix of a full sibling's tokens (the cache's "supersede" rule)."""
    raw = _token_bytes(tokens)
    return hashlib.blake2b(raw, digest_size=KEY_BYTES, person=_DIGEST_PERSON).digest()


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a prompt's plan. ``[start, end)`` are prompt token offsets; ``segment`` indexes the
    prompt's segments; ``partial`` is True when the chunk holds fewer than ``chunk_size`` tokens (the tail of a
    segment). ``parent`` is the prefix tree's link: the key of the chunk before, or at ``start == 0`` the
    namespace root key. ``key == chunk_key(parent, tokens)``, except for the first chunk of a private part after a
    scope switch (`plan_chunks`), whose key hashes ``scope_key(private_root, parent)`` instead of ``parent``."""

    key: bytes
    parent: bytes
    start: int
    end: int
    segment: int
    partial: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def plan_chunks(root: bytes, segments: Sequence[Sequence[int]], chunk_size: int, *,
                private_root: bytes | None = None, private_from: int | None = None) -> list[ChunkSpec]:
    """Cut each segment on its own into ``chunk_size``-token chunks (the last one of a segment may be partial)
    and chain their keys from ``root`` across segments. Empty segments contribute no chunk.

    Sharing scopes: with ``private_from`` (a segment index) and ``private_root`` (the tenant's root), the
    segments before ``private_from`` chain from ``root`` (the shared root) and the chain switches to the private
    root at segment ``private_from``. When no chunk comes before it and the roots differ, the chain simply starts
    at ``private_root`` (a wholly private prompt keys as the plain chain from ``private_root``, as before scopes
    existed). Otherwise the first private chunk's key hashes ``scope_key(private_root, parent)`` in place of its
    parent key (its ``parent`` stays the chunk before it, or ``root``: the prefix tree's link), and every later
    chunk chains on, so nothing at or after a private segment can share a key with a plan under another private
    root. ``private_from=None`` (or past the last segment) is the plain chain from ``root``."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 tokens, got {chunk_size}")
    if len(root) != KEY_BYTES:
        raise ValueError(f"root key must be {KEY_BYTES} bytes, got {len(root)}")
    if private_from is not None:
        if private_root is None or len(private_root) != KEY_BYTES:
            raise ValueError(f"private_from needs a {KEY_BYTES}-byte private_root")
        if isinstance(private_from, bool) or not isinstance(private_from, int) or private_from < 0:
            raise ValueError(f"private_from must be a segment index >= 0 or None, got {private_from!r}")
    specs: list[ChunkSpec] = []
    parent = root
    switch = False  # the next chunk is the first of the private part, keyed through scope_key
    offset = 0
    for seg_index, segment in enumerate(segments):
        seg = np.asarray(segment, dtype="<i8")
        if seg.ndim != 1:
            raise ValueError(f"segment {seg_index} must be a flat sequence of token ids, got shape {seg.shape}")
        if seg_index == private_from:
            assert private_root is not None
            if not specs and private_root != root:
                parent = private_root
            else:
                switch = True
        n = int(seg.shape[0])
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            key = chunk_key(scope_key(private_root, parent) if switch and private_root else parent, seg[lo:hi])
            switch = False
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
