"""Simulated requests: a workload request (document ids, arrival time) turned into the chunk plan the runtime uses.

A prompt is ``[system][doc 1]...[doc k][question]``; every segment is cut into chunks on its own and keys chain
across segments exactly as :func:`pcr_rag.cache.keys.plan_chunks` does (a test checks equality). Documents are
token-id lists: synthetic (seeded, of given lengths) when only lengths are known, or real ones. Because a
document's chunks depend only on its parent key, the builder memoises ``(parent key, document)`` so a 100k-request
trace hashes each distinct document prefix once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pcr_rag.cache.keys import ChunkSpec, chunk_key


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated trace (times in seconds, sizes in tokens)."""

    rid: int
    arrival_s: float
    plan: tuple[ChunkSpec, ...]
    output_tokens: int
    doc_ids: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(c.key for c in self.plan)

    @property
    def prompt_tokens(self) -> int:
        return self.plan[-1].end if self.plan else 0


def synthetic_tokens(name: str, length: int, *, seed: int = 0, vocab: int = 32000) -> list[int]:
    """Deterministic pseudo-random token ids for document ``name`` (same name, length and seed -> same list)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.integers(0, vocab, size=int(length)).tolist()


def lognormal_lengths(
    names: Sequence[str], *, mean_tokens: float, sigma: float = 0.35, min_tokens: int = 16, seed: int = 0
) -> dict[str, int]:
    """Seeded document lengths (tokens) around ``mean_tokens`` with log-normal spread ``sigma``."""
    rng = np.random.default_rng([seed, 7])
    mu = np.log(mean_tokens) - sigma**2 / 2.0
    lens = np.maximum(min_tokens, np.round(rng.lognormal(mu, sigma, size=len(names)))).astype(int)
    return {n: int(v) for n, v in zip(names, lens, strict=True)}


class TraceBuilder:
    """Builds :class:`SimRequest` plans from document ids.

    ``doc_tokens(doc_id)`` returns a document's token ids (its segment, separator included); ``system_tokens`` is
    the shared first segment; each request's question segment has ``question_tokens`` distinct tokens.
    """

    def __init__(
        self,
        root: bytes,
        chunk_size: int,
        doc_tokens: Callable[[str], Sequence[int]] | Mapping[str, Sequence[int]],
        *,
        system_tokens: Sequence[int] = (),
        question_tokens: int = 32,
        seed: int = 0,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0 tokens, got {chunk_size}")
        self.root = root
        self.chunk_size = chunk_size
        self._doc_tokens = doc_tokens.__getitem__ if isinstance(doc_tokens, Mapping) else doc_tokens
        self.system_tokens = list(system_tokens)
        self.question_tokens = int(question_tokens)
        self.seed = seed
        self._memo: dict[tuple[bytes, str], tuple[ChunkSpec, ...]] = {}
        self._doc_cache: dict[str, np.ndarray] = {}
        self._qrng = np.random.default_rng([seed, 11])

    def _segment(self, parent: bytes, tokens: np.ndarray, offset: int, seg_index: int) -> list[ChunkSpec]:
        out: list[ChunkSpec] = []
        n = int(tokens.shape[0])
        cs = self.chunk_size
        for lo in range(0, n, cs):
            hi = min(lo + cs, n)
            key = chunk_key(parent, tokens[lo:hi])
            out.append(ChunkSpec(key, parent, offset + lo, offset + hi, seg_index, (hi - lo) < cs))
            parent = key
        return out

    def _doc(self, doc_id: str) -> np.ndarray:
        arr = self._doc_cache.get(doc_id)
        if arr is None:
            arr = np.asarray(self._doc_tokens(doc_id), dtype="<i8")
            self._doc_cache[doc_id] = arr
        return arr

    def plan(self, doc_ids: Sequence[str], question: Sequence[int]) -> tuple[ChunkSpec, ...]:
        """The chunk plan of ``[system][docs...][question]`` (equal to ``plan_chunks`` on those segments)."""
        specs: list[ChunkSpec] = []
        parent = self.root
        offset = 0
        seg = 0
        if self.system_tokens:
            key = (parent, "\x00system")
            got = self._memo.get(key)
            if got is None:
                got = tuple(self._segment(parent, np.asarray(self.system_tokens, dtype="<i8"), 0, 0))
                self._memo[key] = got
            specs.extend(got)
            parent, offset, seg = got[-1].key, got[-1].end, 1
        for doc_id in doc_ids:
            memo_key = (parent, doc_id)
            got = self._memo.get(memo_key)
            if got is None:
                got = tuple(self._segment(parent, self._doc(doc_id), offset, seg))
                self._memo[memo_key] = got
            if got:
                specs.extend(got)
                parent, offset = got[-1].key, got[-1].end
            seg += 1
        if len(question):
            specs.extend(self._segment(parent, np.asarray(question, dtype="<i8"), offset, seg))
        return tuple(specs)

    def question(self, rid: int) -> np.ndarray:
        """A request's question tokens: the request id then seeded random ids, so every question is distinct
        (deterministic for a given seed and build order)."""
        q = self._qrng.integers(0, 32000, size=max(1, self.question_tokens))
        q[0] = rid
        return q

    def request(self, rid: int, arrival_s: float, doc_ids: Sequence[str], output_tokens: int) -> SimRequest:
        return SimRequest(rid, float(arrival_s), self.plan(doc_ids, self.question(rid)), int(output_tokens),
                          tuple(doc_ids))
