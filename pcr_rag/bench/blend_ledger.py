"""What a blend-mode request placed, reused and computed, replayed from the outside: its placed tokens split into
KV an earlier request left and KV computed for this very request, and the positions it computed.

Why a ledger: blend mode (`pcr_rag.sched.blend`) places every document after the exact prefix from its
position-independent KV, and a document seen for the first time gets that KV from an isolated prefill run for
this request (computed once, then placed). The issue's definition of reuse ("a token is reused when its KV in
every layer comes from the cache") counts only placed KV an earlier request left. The engine's
`RequestMetrics.blended_tokens` counts either those (``blended == placed - fresh``) or, in engines before that
distinction, every placed token (``blended == placed``); the ledger accepts both and gives the split either way,
plus what a raw-forward bound needs: the spans the request computed (in context, and its fresh documents).

The ledger replays blend mode's plan from the outside, in the order the engine began the requests' prefills:
the prompt is laid out with the engine's own `PromptBuilder.build_rag` (the same layout `PCREngine` uses; the
token ids are checked against the engine's prompt), the exact prefix ends where the engine's exact reuse ends,
a document right after it that has no position-independent KV yet is computed in context (as the engine's
runner does, so that it extends the exact tree), and `blend_spans` (the engine's own planner) gives the placed
span of every other document after the exact prefix. A placed document whose token run (its position-independent
identity: the engine keys that KV by blend root + anchor + these tokens) no earlier blend request placed is
*fresh*: its placed tokens were computed in isolation for this request.

Invariants and limits:
- ``blended_reused + fresh == placed``, and the request is ``consistent`` when the engine's ``blended_tokens`` is
  ``placed - fresh`` or ``placed``; otherwise ``fresh`` is None and it is counted as inconsistent (a layout the
  bench could not reproduce, a document too long for the row, a document the engine chose to compute in place,
  a cache failure).
- A document's KV that the cache evicted from every tier after an earlier request placed it is recomputed by the
  engine but counted as reused here: the bench sizes its tiers so that nothing leaves the SSD tier, and reports
  SSD evictions per run.
- The order must be the engine's prefill order (a document computed in isolation is cached when that prefill
  begins, before any later request begins); callers sort concurrent requests by submission + queue time.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcr_rag.sched.blend import BlendDocument, blend_spans

__all__ = ["BlendLedger", "BlendServed", "context_sum"]

_ROOT = b""  # the replayed plan never looks keys up: any root will do


def context_sum(spans: Sequence[tuple[int, int]]) -> float:
    """Sum over every position ``p`` in ``spans`` of ``p + 1/2``: the attention context a causal forward over
    those positions covers. For one span ``[p, p + n)`` it is ``n * (p + n / 2)``, the context term of
    `pcr_rag.bench.trace_bounds.RawForwardFit`."""
    return float(sum((e - s) * (s + e) / 2 for s, e in spans))


@dataclass(frozen=True)
class BlendServed:
    """One blend request as the ledger saw it (tokens; positions of the prompt).

    ``exact``: the exact prefix (reused); ``blended``: the engine's ``blended_tokens``; ``placed``: tokens the
    replayed plan placed; ``fresh``: the part of ``placed`` whose KV was computed in isolation for this request
    (None: not ``consistent``);
    ``compute_spans``: the spans the prefill computed in context (the question, recomputed heads, documents not
    placed), in order; ``fresh_spans``: the prompt positions of the fresh placed tokens."""

    exact: int
    blended: int
    placed: int
    fresh: int | None
    compute_spans: tuple[tuple[int, int], ...]
    fresh_spans: tuple[tuple[int, int], ...]
    consistent: bool

    @property
    def blended_reused(self) -> int | None:
        """Placed tokens whose KV an earlier request left (None when not ``consistent``)."""
        return None if self.fresh is None else self.placed - self.fresh

    @property
    def computed_spans(self) -> tuple[tuple[int, int], ...]:
        """Every position this request computed: in context, or in isolation for a fresh document (counted at its
        prompt position, i.e. against the prompt's context)."""
        return tuple(sorted((*self.compute_spans, *self.fresh_spans)))


@dataclass
class BlendLedger:
    """The position-independent documents one blend engine holds, fed its requests in prefill order (see the
    module docstring). ``recompute``: the engine's ``blend_recompute``; ``system``: the system prompt its requests
    are sent with. Not thread-safe."""

    builder: Any  # pcr_rag.prompt.PromptBuilder of the engine's tokenizer
    recompute: float
    system: str | None = None
    seen: set[Hashable] = field(default_factory=set)
    inconsistent: int = 0

    def serve(self, question: str, documents: Sequence[str], prompt_ids: Sequence[int], exact: int,
              blended: int) -> BlendServed:
        """Record one blend request (``exact``: its exact reused tokens; ``blended``: the engine's
        ``blended_tokens``) and split its placed tokens into reused and fresh."""
        seg = self.builder.build_rag(question, list(documents), self.system)
        total = len(prompt_ids)
        if seg.token_ids != list(prompt_ids):
            self.inconsistent += 1
            return BlendServed(exact, blended, 0, None, ((exact, total),) if blended == 0 else (), (), False)
        offsets = [0]
        for s in seg.segments:
            offsets.append(offsets[-1] + len(s))
        docs = [BlendDocument(offsets[i], offsets[i + 1], _ROOT) for i in seg.document_segments]
        runs = [tuple(prompt_ids[d.start: d.end]) for d in docs]
        wanted = [i for i, d in enumerate(docs) if d.end > exact]
        if wanted and docs[wanted[0]].start >= exact and runs[wanted[0]] not in self.seen:
            wanted = wanted[1:]  # the engine computes a new document right after the exact match in context
        spans = blend_spans(total, exact, docs, wanted, self.recompute)
        placed = [s for s in spans if s.placed]
        computes = tuple((s.start, s.end) for s in spans if not s.placed)
        fresh: list[tuple[int, int]] = []
        for s in placed:  # in prompt order, as the engine gets them: a repeat within the prompt is cached by then
            if runs[s.document] not in self.seen:
                fresh.append((s.start, s.end))
                self.seen.add(runs[s.document])
        fresh_spans = tuple(fresh)
        n_placed = sum(s.end - s.start for s in placed)
        n_fresh = sum(e - s for s, e in fresh_spans)
        if blended not in (n_placed - n_fresh, n_placed):
            self.inconsistent += 1
            return BlendServed(exact, blended, n_placed, None, computes, fresh_spans, False)
        return BlendServed(exact, blended, n_placed, n_fresh, computes, fresh_spans, True)
