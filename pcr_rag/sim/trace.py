"""Simulated requests: a workload request (document ids, arrival time) turned into the chunk plan the runtime uses.

A prompt is ``[system][doc 1]...[doc k][question]``; every segment is cut into chunks on its own and keys chain
across segments exactly as :func:`pcr_rag.cache.keys.plan_chunks` does (a test checks equality). Documents are
token-id lists: synthetic (seeded, of given lengths) when only lengths are known, or real ones. Because a
document's chunks depend only on its parent key, the builder memoises ``(parent key, document)`` so a 100k-request
trace hashes each distinct document prefix once.

Blend mode (`pcr_rag.sched.blend`): each request also carries its documents (`SimDocument`: prompt offsets and
the chunk plan of the document's position-independent chain ``[anchor][document]`` under the blend root of the
builder's root, as `PCREngine._blend_request` keys it), memoised per document id, since that chain depends on the
document's own tokens only.

Trace files (`trace_requests`): the RAG segment trace that ``pcr-rag bench --trace`` replays
(`pcr_rag.bench.trace_file`) becomes requests laid out as the bench lays them out (`pcr_rag.bench.trace_bounds`):
every segment but the question (system parts, passages, history) is one document, in trace order, keyed by its
identity (kind, id, length), so the same identity is the same tokens in every request; the question is the
question segment. The engine's head (chat template, system prompt, instruction) is the builder's
``system_tokens``, and its separators are not modelled: prompts hold the trace's own lengths plus the head.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pcr_rag.bench.trace_file import Trace, TraceRequest, TraceSegment
from pcr_rag.cache.keys import ChunkSpec, blend_root, chunk_key


@dataclass(frozen=True)
class SimDocument:
    """One document of a request (blend mode): prompt offsets ``[start, end)`` (tokens), its id, and ``plan``, the
    chunk plan of its position-independent chain ``[anchor][document]`` (the anchor's chunks first, then the
    document's, which start at position ``anchor_tokens`` of that chain)."""

    start: int
    end: int
    doc_id: str
    plan: tuple[ChunkSpec, ...]
    anchor_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(c.key for c in self.plan)


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated trace (times in seconds, sizes in tokens)."""

    rid: int
    arrival_s: float
    plan: tuple[ChunkSpec, ...]
    output_tokens: int
    doc_ids: tuple[str, ...] = ()
    documents: tuple[SimDocument, ...] = ()

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
    ``anchor_tokens`` is blend mode's fixed head that documents' position-independent KV is computed behind (the
    engine's default head; None: ``system_tokens``, which holds no key in common with it: the chains live under
    the blend root).
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
        anchor_tokens: Sequence[int] | None = None,
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
        anchor = self.system_tokens if anchor_tokens is None else list(anchor_tokens)
        self.blend_root = blend_root(root)
        self._anchor_plan = tuple(self._segment(self.blend_root, np.asarray(anchor, dtype="<i8"), 0, 0))
        self.anchor_tokens = len(anchor)
        self._iso: dict[str, tuple[ChunkSpec, ...]] = {}

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

    def isolated_plan(self, doc_id: str) -> tuple[ChunkSpec, ...]:
        """The chunk plan of ``doc_id``'s position-independent chain ``[anchor][document]`` (equal to
        ``plan_chunks(blend_root(root), [anchor, document], chunk_size)``)."""
        got = self._iso.get(doc_id)
        if got is None:
            anchor = self._anchor_plan
            parent = anchor[-1].key if anchor else self.blend_root
            got = anchor + tuple(self._segment(parent, self._doc(doc_id), self.anchor_tokens, 1))
            self._iso[doc_id] = got
        return got

    def documents(self, doc_ids: Sequence[str]) -> tuple[SimDocument, ...]:
        """The documents of a prompt ``[system][docs...][question]`` with their offsets and isolated plans (empty
        documents left out: they have no tokens to place)."""
        out: list[SimDocument] = []
        pos = len(self.system_tokens)
        for doc_id in doc_ids:
            n = int(self._doc(doc_id).shape[0])
            if n:
                out.append(SimDocument(pos, pos + n, doc_id, self.isolated_plan(doc_id), self.anchor_tokens))
            pos += n
        return tuple(out)

    def question(self, rid: int) -> np.ndarray:
        """A request's question tokens: the request id then seeded random ids, so every question is distinct
        (deterministic for a given seed and build order)."""
        q = self._qrng.integers(0, 32000, size=max(1, self.question_tokens))
        q[0] = rid
        return q

    def request(self, rid: int, arrival_s: float, doc_ids: Sequence[str], output_tokens: int,
                question: Sequence[int] | None = None) -> SimRequest:
        """A request of ``doc_ids`` with ``question`` (None: a distinct one of ``question_tokens``, `question`)."""
        q = self.question(rid) if question is None else question
        return SimRequest(rid, float(arrival_s), self.plan(doc_ids, q), int(output_tokens), tuple(doc_ids),
                          self.documents(doc_ids))


def segment_doc_id(segment: TraceSegment) -> str:
    """A trace segment's document id: its identity (kind, id, length), so one identity is one token run
    (the bench's document key for the same segment)."""
    return f"{segment.kind}/{segment.id}#{segment.tokens}"


def segment_tokens(doc_id: str, *, seed: int = 0) -> list[int]:
    """Synthetic token ids of a `segment_doc_id` (its length is the id's ``#tokens``)."""
    return synthetic_tokens(doc_id, int(doc_id.rsplit("#", 1)[1]), seed=seed)


def warmup_requests(first: TraceRequest, n: int) -> list[TraceRequest]:
    """``n`` requests shaped like ``first`` whose segments are their own (ids no trace request has), as the bench's
    trace replay warms up (`pcr_rag.bench.trace_replay`): they warm the shared head, and in blend mode the anchor,
    and nothing else."""
    return [replace(first, segments=tuple(replace(s, id=f"~warmup-{w}/{s.id}") for s in first.segments))
            for w in range(n)]


def trace_requests(trace: Trace | Sequence[TraceRequest], builder: TraceBuilder, arrivals_s: Sequence[float], *,
                   default_output: int, rid_offset: int = 0) -> list[SimRequest]:
    """Requests of a trace file's requests (see the module docstring), arriving at ``arrivals_s`` (seconds, one per
    request); ``builder`` must make a document's tokens from its id (`segment_tokens`). A request's output is the
    trace's ``output_length`` (at least 1), else ``default_output``. A request without a question segment gets
    one token of its own after the documents (the runtime always computes a last token)."""
    reqs = trace.requests if isinstance(trace, Trace) else tuple(trace)
    if len(arrivals_s) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(arrivals_s)} arrival times")
    out: list[SimRequest] = []
    for i, (r, t) in enumerate(zip(reqs, arrivals_s, strict=True)):
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"arrival time of request {i} must be finite and >= 0, got {t}")
        rid = rid_offset + i
        docs = [segment_doc_id(s) for s in r.segments if s.kind != "question"]
        q = r.question
        question = segment_tokens(segment_doc_id(q), seed=builder.seed) if q is not None else [rid]
        output = max(1, r.output_length) if r.output_length is not None else int(default_output)
        out.append(builder.request(rid, t, docs, output, question))
    return out
