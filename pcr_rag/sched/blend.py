"""Blend mode: reuse a document's KV in any position (opt-in, approximate, reported per response).

Exact reuse (the prefix tree) serves a document's KV only behind the same system prompt and the same earlier
documents. Blend mode also keeps each document's KV in a *position-independent* form: the exact KV of the prompt
``[anchor][document]``, computed once on its own behind a fixed, document-independent ``anchor`` (the engine's
default head: its chat template and instruction), and keyed by a blend root (`pcr_rag.cache.keys.blend_root`) of
the request's namespace root, so it lives in the same tiers and prefix tree as any chunk, in a key space of its own,
under the same sharing scopes, quotas, seals and eviction.

A blend request's prefill (`pcr_rag.sched.runner.PrefillTask`) is then a plan of spans (`blend_spans`):
1. the exact prefix match, loaded as in exact mode;
2. for each later document: its first ``ceil(recompute * n)`` tokens computed in context, the rest *placed* -
   copied from its isolated KV with the keys rotated to their new positions (`pcr_rag.model.rope_shift`). A
   document seen for the first time is computed once, in isolation, and placed; except the document right after
   the exact match, which is then computed in context (exact, at the same cost, and it extends the exact tree);
3. everything else computed: documents without such KV, the query and every token after the documents, and
   always the last token (its logits pick the first output token).

Why the first tokens (EPIC's choice) and not CacheBlend's most-deviating tokens: the forward computes contiguous
spans of positions (fixed tiles, attention blocks aligned to positions), so a document's first tokens are one more
contiguous compute span; CacheBlend's selection needs a first pass over every token and a forward over scattered
positions. The first tokens are also where isolation hurts most: they attended to the anchor, not to the real
context, and later tokens read them (the attention sink a document starts with).

Invariants:
- A request in exact mode carries no `BlendRequest` and does no blend work.
- KV computed after the first placed position is not exact: none of it is inserted into the exact prefix tree
  (`PrefillTask` stops inserting plan chunks at `BlendPlan.exact_until`). Position-independent entries are exact
  KV of their own ``[anchor][document]`` prompts, so they obey every invariant of the tree.
- Placed KV is written before the first compute span of the blend part runs, and the row is zero-filled from the
  exact prefix to the end of the prompt first, so no compute step's zero-fill can wipe placed positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pcr_rag.cache import ChunkSpec, plan_chunks

if TYPE_CHECKING:
    from pcr_rag.model.kv_arena import RowKV
    from pcr_rag.model.rope_shift import RopeShift

@dataclass(frozen=True)
class BlendDocument:
    """One document segment of a blend request: prompt token offsets ``[start, end)`` (its lead and separator
    included, as the exact plan cuts it) and ``root``, the blend root its position-independent KV is keyed under
    (of the engine-wide root for a shared segment, of the tenant's root from the first private one on)."""

    start: int
    end: int
    root: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BlendRequest:
    """What a blend request's prefill needs besides its exact plan: the anchor's token ids, its document
    segments in prompt order, the fraction of each placed document's tokens recomputed first, the chunk size of
    the position-independent chains, and their keys (``chains``, one per document: what the prefetcher loads
    ahead of the request)."""

    anchor: tuple[int, ...]
    documents: tuple[BlendDocument, ...]
    recompute: float
    chunk_size: int
    chains: tuple[tuple[bytes, ...], ...]

    @classmethod
    def build(cls, anchor: Sequence[int], documents: Sequence[BlendDocument], recompute: float, chunk_size: int,
              token_ids: Sequence[int]) -> BlendRequest:
        """The request for a prompt of ``token_ids``, its documents' chain keys derived once."""
        anchor, documents = tuple(anchor), tuple(documents)
        chains = tuple(tuple(c.key for c in _chain(d, anchor, token_ids, chunk_size)) for d in documents)
        return cls(anchor, documents, recompute, chunk_size, chains)

    def document_plan(self, doc: BlendDocument, token_ids: Sequence[int]) -> list[ChunkSpec]:
        """The chunk plan of ``doc``'s position-independent chain: ``[anchor][document]`` under its blend root."""
        return _chain(doc, self.anchor, token_ids, self.chunk_size)


def _chain(doc: BlendDocument, anchor: Sequence[int], token_ids: Sequence[int], chunk_size: int) -> list[ChunkSpec]:
    """``[anchor][document]`` cut into chunks under the document's blend root (one segment each)."""
    return plan_chunks(doc.root, [list(anchor), list(token_ids[doc.start: doc.end])], chunk_size)


@dataclass(frozen=True)
class Span:
    """Positions ``[start, end)`` of a blend prefill: computed by the forward, or placed (``document``: the
    index into `BlendRequest.documents` whose KV is placed there)."""

    start: int
    end: int
    document: int | None = None

    @property
    def placed(self) -> bool:
        return self.document is not None


def recomputed_head(doc: BlendDocument, recompute: float) -> int:
    """Leading tokens of ``doc`` computed in context before the rest is placed: ``ceil(recompute * n)``."""
    return min(doc.num_tokens, math.ceil(recompute * doc.num_tokens))


def blend_spans(total: int, exact_end: int, documents: Sequence[BlendDocument], placeable: Sequence[int],
                recompute: float) -> tuple[Span, ...]:
    """The spans of a prompt of ``total`` tokens whose positions ``[0, exact_end)`` are the exact prefix: each
    document in ``placeable`` (indexes into ``documents``, in prompt order) is placed after its first
    ``ceil(recompute * n)`` tokens and after the exact prefix (which may end inside it); everything else from
    ``exact_end`` on is computed, the last position always. Spans are contiguous, ordered, non-empty and cover ``[exact_end, total)``; the last
    one is computed."""
    spans: list[Span] = []
    pos = exact_end
    for index in placeable:
        doc = documents[index]
        # its head is recomputed in context, unless the exact prefix already holds it (then it is exact)
        first = max(pos, doc.start + recomputed_head(doc, recompute))
        last = min(doc.end, total - 1)
        if last <= first:
            continue
        if pos < first:
            spans.append(Span(pos, first))
        spans.append(Span(first, last, index))
        pos = last
    spans.append(Span(pos, total))
    return tuple(spans)


@dataclass(frozen=True)
class PlacedPiece:
    """Part of a document's position-independent KV: tokens ``[lo, hi)`` of ``payload`` (``[layers, 2, kv_heads,
    tokens, head_dim]``), which sit at position ``source`` of the isolated computation, go to row position
    ``target``."""

    payload: torch.Tensor
    lo: int
    hi: int
    source: int
    target: int


@dataclass
class Placement:
    """The placed spans of one blend prefill, written into the row one layer at a time (`place_layer`, from the
    first compute step's hooks, so a layer's placed KV is in the row before any attention of that layer reads
    it). Idempotent per layer."""

    row: RowKV
    shift: RopeShift
    kinds: Sequence[str]  # rotary kind of each layer
    pieces: list[PlacedPiece]
    placed: set[int] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.placed) == len(self.kinds)

    def place_layer(self, layer: int) -> None:
        if layer in self.placed:
            return
        arena, r = self.row.arena, self.row.row
        for p in self.pieces:
            n = p.hi - p.lo
            keys = p.payload[layer, 0, :, p.lo: p.hi].to(arena.device)
            arena.k[layer][r, :, p.target: p.target + n].copy_(
                self.shift.shift(keys, self.kinds[layer], p.target - p.source))
            arena.v[layer][r, :, p.target: p.target + n].copy_(p.payload[layer, 1, :, p.lo: p.hi])
        self.placed.add(layer)
        if self.done:
            self.pieces = []  # the payloads are no longer needed

    def place_all(self) -> None:
        for layer in range(len(self.kinds)):
            self.place_layer(layer)
