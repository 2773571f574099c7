"""The reuse bounds of a replayed trace, and the TTFT bound each implies, at chunk granularity in the engine's own
prompt layout.

Layout (`request_layout`): a trace request is served as the engine's RAG prompt (`PromptBuilder.build_rag` with the
bench's system prompt): every segment but the question is one engine document, in trace order (system parts,
passages, history), so each segment is its own token run and its own chunks (`plan_chunks`); the question is the
query. The head (chat template, the bench's system prompt, the instruction) is the same in every request.

Bounds, as fractions of all prompt tokens of the replayed requests (head, separators and question included), each
for a cache that never evicts, walked in arrival order after the warm-up requests (which count for what is cached,
not in the fractions):

* ``prefix``: an exact prefix cache, as served (the longest prefix of the request's chunk chain served before;
  `pcr_rag.bench.reorder.PrefixSet`). A volatile system part before the passages ends every match there.
* ``prefix_moved``: the same with the volatile system parts moved after the passages (static system parts,
  passages, volatile parts, history).
* ``cache_aware``: the moved layout with each request's passages in cache-aware order (`order_trace`, which also
  gives the bound over passage tokens alone in both orders). None for a trace without passages (Mooncake).
* ``position_independent``: the exact prefix as served, plus every segment whose identity (kind, id, length) an
  earlier request held in any position (a position-independent store reuses it whole). A block-hash trace cannot
  exceed ``prefix`` here: its ids chain by prefix, so a seen block always sits after the prefix it was seen after.

A token counts as reused only when the bound reuses its KV; the TTFT bound of a request is a raw forward of its
other tokens (at least one: the first output token needs logits) after the reused ones (`RawForwardFit`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcr_rag.bench.reorder import PrefixSet, ReuseBound, order_trace
from pcr_rag.bench.stats import RatioInterval, RequestTable, paired_ratio_interval
from pcr_rag.bench.targets import (
    BLEND_LIMIT_RATIO_MAX,
    BLEND_MIN_REUSE_OVER_POSITION_INDEPENDENT,
    BLEND_VS_PCR_MEAN_TTFT_MAX,
)
from pcr_rag.bench.trace_file import TraceRequest, TraceSegment
from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.prompt import PromptBuilder

log = logging.getLogger(__name__)

__all__ = [
    "BOUND_NAMES",
    "BoundCounts",
    "LaidOut",
    "LayoutPlanner",
    "RawForwardFit",
    "RequestLayout",
    "TraceBounds",
    "blend_markdown",
    "blend_section",
    "bounds_markdown",
    "bounds_section",
    "compute_bounds",
    "matched_prefix_tokens",
    "raw_forward_seconds",
    "request_layout",
    "reuse_split",
]

#: The bounds, in the order they are reported (each at least the one before on real traffic).
BOUND_NAMES: tuple[str, ...] = ("prefix", "prefix_moved", "cache_aware", "position_independent")
BOUND_LABELS: Mapping[str, str] = {
    "no_reuse": "no reuse (every token computed)",
    "prefix": "prefix, as served (exact, unbounded cache)",
    "prefix_moved": "prefix, volatile system parts moved after the passages",
    "cache_aware": "cache-aware passage order (volatile parts moved)",
    "position_independent": "position-independent (any segment seen before, any position)",
}
#: The identity of the head segment (template, system prompt, instruction): the same text in every request.
HEAD: Hashable = ("<head>",)


@dataclass(frozen=True)
class RequestLayout:
    """One request as engine documents: ``documents`` ((segment identity, text), in prompt order), the passages
    at ``documents[passages[0]:passages[1]]``, the ``question`` text (the query; "" when the trace has none) and
    its identity (None: none, so the question part is reused only inside an exact prefix)."""

    documents: tuple[tuple[Hashable, str], ...]
    passages: tuple[int, int]
    question: str
    question_id: Hashable | None

    def ordered(self, order: Sequence[int] | None) -> tuple[tuple[Hashable, str], ...]:
        """The documents with the passages in ``order`` (indices into the passages; None: as given)."""
        if order is None:
            return self.documents
        s, e = self.passages
        p = self.documents[s:e]
        if sorted(order) != list(range(len(p))):
            raise ValueError(f"order {tuple(order)} is not a permutation of {len(p)} passages")
        return (*self.documents[:s], *(p[i] for i in order), *self.documents[e:])


def request_layout(request: TraceRequest, text: Callable[[TraceSegment], str], *, moved: bool) -> RequestLayout:
    """``request`` as engine documents (see the module docstring); ``moved``: volatile system parts go after the
    passages (before the history)."""
    body = [s for s in request.segments if s.kind != "question"]
    if moved:
        body = ([s for s in body if s.kind == "system" and not s.volatile]
                + [s for s in body if s.kind not in ("system", "history")]
                + [s for s in body if s.kind == "system" and s.volatile]
                + [s for s in body if s.kind == "history"])
    kinds = [s.kind for s in body]
    start = kinds.index("passage") if "passage" in kinds else 0
    stop = start + kinds.count("passage")
    q = request.question
    return RequestLayout(tuple((s.identity, text(s)) for s in body), (start, stop),
                         text(q) if q is not None else "", q.identity if q is not None else None)


@dataclass(frozen=True)
class LaidOut:
    """A request in the engine's layout: its token ``segments``, the segment identity of each (`HEAD`, a document's,
    the question's; None: unknown) and its chunk ``plan`` (`pcr_rag.cache.keys.ChunkSpec`)."""

    segments: tuple[tuple[int, ...], ...]
    identities: tuple[Hashable | None, ...]
    plan: tuple[Any, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s]


class LayoutPlanner:
    """Lays requests out with the engine's own `PromptBuilder.build_rag` and cuts them with `plan_chunks`.

    A reordering of passages is assembled from the token runs of earlier layouts instead of re-tokenizing the
    whole prompt (the cache-aware order tries up to 120 orders per request): `PromptBuilder` gives a document the
    same run in every position with the same lead (first, or after another document) when its cuts needed no
    adjustment, and the head and question runs do not depend on the documents. Every layout asked for with
    ``exact=True`` is built whole and, where its runs were known, checked against the assembly; one mismatch
    turns assembling off for the rest of the trace (logged)."""

    def __init__(self, builder: PromptBuilder, system: str | None, chunk_size: int) -> None:
        self.builder = builder
        self.system = system
        self.chunk_size = chunk_size
        self.root = namespace_key("bench-trace", "any", chunk_size)
        self._runs: dict[Hashable, tuple[tuple[int, ...], ...]] = {}
        self._exact: dict[Hashable, LaidOut] = {}
        self.assembling = True
        self.checked = 0
        self.unclean = 0

    def lay_out(self, layout: RequestLayout, order: Sequence[int] | None = None, *, exact: bool = True) -> LaidOut:
        docs = layout.ordered(order)
        memo = (layout.question, tuple(i for i, _ in docs))
        if memo in self._exact:
            return self._exact[memo]
        if not exact and self.assembling:
            assembled = self._assemble(layout, docs)
            if assembled is not None:
                return assembled
        seg = self.builder.build_rag(layout.question, [t for _, t in docs], self.system)
        k = len(docs)
        clean = k > 0 and seg.documents_found == k and seg.cuts_adjusted == 0 and len(seg.segments) > k
        if clean:
            tail = seg.segments[1 + k:]
            identities = (HEAD, *(i for i, _ in docs), *([layout.question_id] * len(tail)))
            before = self._assemble(layout, docs)
            self._harvest(layout, docs, seg.segments)
            if before is not None:
                self.checked += 1
                if before.segments != seg.segments and self.assembling:
                    log.warning("a reordered layout assembled from token runs differs from the engine's own; "
                                "building every layout whole from now on")
                    self.assembling = False
        else:
            if k:
                self.unclean += 1
            identities = tuple([layout.question_id if not k else None] * len(seg.segments))
        out = self._laid(seg.segments, identities)
        self._exact[memo] = out
        return out

    def _laid(self, segments: Sequence[Sequence[int]], identities: Sequence[Hashable | None]) -> LaidOut:
        segs = tuple(tuple(s) for s in segments)
        return LaidOut(segs, tuple(identities), tuple(plan_chunks(self.root, segs, self.chunk_size)))

    def _harvest(self, layout: RequestLayout, docs: Sequence[tuple[Hashable, str]],
                 segments: Sequence[Sequence[int]]) -> None:
        k = len(docs)
        self._runs[HEAD] = (tuple(segments[0]),)
        for j, (ident, _) in enumerate(docs):
            self._runs[(ident, j == 0)] = (tuple(segments[1 + j]),)
        self._runs[("<tail>", layout.question)] = tuple(tuple(s) for s in segments[1 + k:])

    def _assemble(self, layout: RequestLayout, docs: Sequence[tuple[Hashable, str]]) -> LaidOut | None:
        if not docs:
            return None
        parts = [self._runs.get(HEAD), *(self._runs.get((i, j == 0)) for j, (i, _) in enumerate(docs)),
                 self._runs.get(("<tail>", layout.question))]
        if any(p is None for p in parts):
            return None
        segments = [s for p in parts for s in p]  # type: ignore[union-attr]
        tail = len(parts[-1])  # type: ignore[arg-type]
        return self._laid(segments, (HEAD, *(i for i, _ in docs), *([layout.question_id] * tail)))


@dataclass(frozen=True)
class _Chunk:
    key: bytes
    num_tokens: int
    segment: int


def matched_prefix_tokens(seen: PrefixSet, plan: Sequence[Any]) -> int:
    """Tokens of ``plan``'s longest prefix of chunks ``seen`` holds, every segment counted (head and question
    too: `PrefixSet.matched_doc_tokens` counts documents, so every chunk is relabelled one)."""
    return seen.matched_doc_tokens([_Chunk(c.key, c.num_tokens, 1) for c in plan], 1)


@dataclass(frozen=True)
class BoundCounts:
    """Per replayed request: tokens a bound reuses and prompt tokens of the layout it is computed on."""

    reused: tuple[int, ...]
    prompt: tuple[int, ...]

    @property
    def fraction(self) -> float:
        total = sum(self.prompt)
        return sum(self.reused) / total if total else 0.0

    def computed(self) -> list[int]:
        """Tokens each request must compute (at least one: the first output token needs logits)."""
        return [max(1, p - r) for r, p in zip(self.reused, self.prompt, strict=True)]


@dataclass(frozen=True)
class TraceBounds:
    """The bounds of a replayed trace (module docstring). ``served``: each replayed request as served;
    ``passages``: the bound over passage tokens alone in relevance and cache-aware order (moved layout; None
    without passages); ``stored_tokens``: tokens an unbounded prefix cache holds after the trace (warm-up
    included); ``unclean``: layouts whose documents the prompt builder could not cut cleanly (their segments
    count only inside an exact prefix)."""

    served: tuple[LaidOut, ...]
    prefix: BoundCounts
    prefix_moved: BoundCounts
    cache_aware: BoundCounts | None
    position_independent: BoundCounts
    passages: ReuseBound | None
    stored_tokens: int
    unclean: int = 0
    moved_differs: bool = False

    def by_name(self) -> dict[str, BoundCounts | None]:
        return {n: getattr(self, n) for n in BOUND_NAMES}


def compute_bounds(warmup: Sequence[tuple[RequestLayout, RequestLayout]],
                   requests: Sequence[tuple[RequestLayout, RequestLayout]], planner: LayoutPlanner, *,
                   cache_aware: bool = True) -> TraceBounds:
    """Walk ``warmup`` then ``requests`` ((served, moved) layouts each, in arrival order) and count every bound
    over ``requests`` (see the module docstring)."""
    everything = [*warmup, *requests]
    skip = len(warmup)
    served_seen, moved_seen = PrefixSet(), PrefixSet()
    seen_ids: set[Hashable] = set()
    served: list[LaidOut] = []
    prefix, moved, pi, prompt, moved_prompt = [], [], [], [], []
    stored: set[bytes] = set()
    stored_tokens = 0
    moved_differs = False
    for n, (s_layout, m_layout) in enumerate(everything):
        laid = planner.lay_out(s_layout)
        matched = matched_prefix_tokens(served_seen, laid.plan)
        served_seen.add(laid.plan)
        for c in laid.plan:
            if c.key not in stored:
                stored.add(c.key)
                stored_tokens += c.num_tokens
        reusable, offset = 0, 0
        for seg, ident in zip(laid.segments, laid.identities, strict=True):
            covered = min(max(matched - offset, 0), len(seg))
            reusable += len(seg) if ident is not None and ident in seen_ids else covered
            offset += len(seg)
        seen_ids.update(i for i in laid.identities if i is not None)
        m_laid = planner.lay_out(m_layout)
        moved_differs |= m_laid.segments != laid.segments
        m_matched = matched_prefix_tokens(moved_seen, m_laid.plan)
        moved_seen.add(m_laid.plan)
        if n >= skip:
            served.append(laid)
            prefix.append(matched)
            pi.append(reusable)
            prompt.append(laid.num_tokens)
            moved.append(m_matched)
            moved_prompt.append(m_laid.num_tokens)
    aware: BoundCounts | None = None
    passages: ReuseBound | None = None
    if cache_aware and any(m.passages[1] > m.passages[0] for _, m in everything):
        aware, passages = _cache_aware(everything, skip, planner)
    return TraceBounds(tuple(served), BoundCounts(tuple(prefix), tuple(prompt)),
                       BoundCounts(tuple(moved), tuple(moved_prompt)), aware, BoundCounts(tuple(pi), tuple(prompt)),
                       passages, stored_tokens, planner.unclean, moved_differs)


def _cache_aware(everything: Sequence[tuple[RequestLayout, RequestLayout]], skip: int,
                 planner: LayoutPlanner) -> tuple[BoundCounts, ReuseBound]:
    """The moved layouts with each request's passages in `order_trace`'s cache-aware order: all-token counts of
    the replayed requests, and the bound over their passage tokens alone in relevance and cache-aware order
    (`PrefixSet.matched_doc_tokens` over plans whose documents are the passages)."""
    moved = [m for _, m in everything]

    def plan(key: str, positions: Sequence[str]) -> list[_Chunk]:
        layout = moved[int(key)]
        laid = planner.lay_out(layout, [int(p) for p in positions], exact=False)
        s, e = layout.passages
        k = e - s
        return [_Chunk(c.key, c.num_tokens, 0 if c.segment < 1 + s else c.segment - s if c.segment < 1 + e else k + 1)
                for c in laid.plan]

    items = [(str(i), [str(p) for p in range(m.passages[1] - m.passages[0])]) for i, m in enumerate(moved)]
    orders, _ = order_trace(items, plan)
    seen, rel_seen = PrefixSet(), PrefixSet()
    reused, prompt = [], []
    passage_tokens = rel_matched = aware_matched = reordered = 0
    for n, ((key, positions), order) in enumerate(zip(items, orders, strict=True)):
        k = len(positions)
        laid = planner.lay_out(moved[n], order, exact=False)
        rel_plan = plan(key, positions)
        aware_plan = plan(key, [str(i) for i in order])
        if n >= skip:
            reused.append(matched_prefix_tokens(seen, laid.plan))
            prompt.append(laid.num_tokens)
            passage_tokens += sum(c.num_tokens for c in rel_plan if 1 <= c.segment <= k)
            rel_matched += rel_seen.matched_doc_tokens(rel_plan, k)
            aware_matched += seen.matched_doc_tokens(aware_plan, k)
            reordered += tuple(order) != tuple(range(k))
        seen.add(laid.plan)
        rel_seen.add(rel_plan)
    bound = ReuseBound(rel_matched / passage_tokens if passage_tokens else 0.0,
                       aware_matched / passage_tokens if passage_tokens else 0.0, passage_tokens, reordered,
                       len(items) - skip)
    return BoundCounts(tuple(reused), tuple(prompt)), bound


# ---------------------------------------------------------------------------------------------- TTFT bound
@dataclass(frozen=True)
class RawForwardFit:
    """Seconds of a raw forward of ``new`` tokens after ``prefix`` resident ones (plus the first token's argmax):
    ``fixed_s + per_token_s * new + per_token_context_s * new * (prefix + new / 2)``, the last term being attention
    over the context. Fitted by least squares to measured ``points`` ((prefix, new, seconds)); a term whose
    coefficient comes out negative (noise) is dropped and the rest refitted."""

    fixed_s: float
    per_token_s: float
    per_token_context_s: float
    points: tuple[tuple[int, int, float], ...] = field(default=())

    def seconds(self, new: int, prefix: int) -> float:
        return self.fixed_s + self.per_token_s * new + self.per_token_context_s * new * (prefix + new / 2)

    def seconds_at(self, new: int, context: float) -> float:
        """One raw forward of ``new`` tokens at any positions whose ``context`` is the sum of ``position + 1/2``
        over them (`pcr_rag.bench.blend_ledger.context_sum`; ``new * (prefix + new / 2)`` for a suffix)."""
        return self.fixed_s + self.per_token_s * new + self.per_token_context_s * context

    def attention_share(self, tokens: int) -> float:
        """The share of a full prefill of ``tokens`` (no cached prefix) that the context term (attention over
        the context) takes; 0 for no tokens."""
        if tokens <= 0:
            return 0.0
        total = self.seconds(tokens, 0)
        return self.per_token_context_s * tokens * tokens / 2 / total if total > 0 else 0.0

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> RawForwardFit:
        if len(points) < 3:
            raise ValueError(f"a raw-forward fit needs at least 3 points, got {len(points)}")
        x = np.array([[1.0, n, n * (p + n / 2)] for p, n, _ in points])
        y = np.array([t for _, _, t in points])
        keep = [0, 1, 2]
        coef = np.zeros(3)
        while keep:
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (sol >= 0).all():
                coef[keep] = sol
                break
            keep = [k for k, v in zip(keep, sol, strict=True) if v >= 0]
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), tuple(points))

    def as_dict(self) -> dict[str, Any]:
        return {"fixed_s": self.fixed_s, "per_token_s": self.per_token_s,
                "per_token_context_s": self.per_token_context_s,
                "points": [{"prefix": p, "new": n, "seconds": t} for p, n, t in self.points]}


def _ttft_bound(fit: RawForwardFit, computed: Sequence[int], prompt: Sequence[int]) -> float:
    return statistics.mean(fit.seconds(c, p - c) for c, p in zip(computed, prompt, strict=True))


# ---------------------------------------------------------------------------------------------- report
def bounds_section(bounds: TraceBounds, runs: Sequence[Mapping[str, Any]], *, fit: RawForwardFit | None,
                   info: Mapping[str, Any], notes: Sequence[str] = ()) -> dict[str, Any]:
    """The report's ``bounds`` section: every bound (fraction of prompt tokens, mean computed tokens, TTFT bound)
    and what each replayed system reached next to them."""
    rows: dict[str, Any] = {}
    served_prompt = bounds.prefix.prompt
    nothing = BoundCounts(tuple(0 for _ in served_prompt), served_prompt)
    for name, counts in {"no_reuse": nothing, **bounds.by_name()}.items():
        if counts is None:
            rows[name] = None
            continue
        computed = counts.computed()
        rows[name] = {
            "label": BOUND_LABELS[name], "fraction": counts.fraction, "reused_tokens": sum(counts.reused),
            "prompt_tokens": sum(counts.prompt), "computed_tokens_mean": statistics.mean(computed) if computed else 0,
            "ttft_bound_s": _ttft_bound(fit, computed, counts.prompt) if fit is not None and computed else None,
        }
    prefix, pi = rows["prefix"], rows["position_independent"]
    reached = []
    for run in runs:
        req = run.get("requests") or {}
        p_tok = list(req.get("prompt_tokens") or [])
        split = reuse_split(run)
        raws = raw_forward_seconds(run, fit) if fit is not None and p_tok else None
        raw = statistics.mean(raws) if raws else None
        mean_ttft = (run.get("ttft") or {}).get("mean")
        total = split["reuse"]
        reached.append({
            "system": run["system"], "reuse": total, "exact_reuse": split["exact"], "blended": split["blended"],
            "blended_reused": split["blended_reused"], "blended_fresh": split["blended_fresh"],
            "prompt_tokens": sum(p_tok), "prompt_tokens_as_laid_out": p_tok == list(served_prompt),
            "reuse_over_prefix_bound": (total / prefix["fraction"]
                                        if prefix["fraction"] and total is not None else None),
            "reuse_over_position_independent_bound": (total / pi["fraction"]
                                                      if pi and pi["fraction"] and total is not None else None),
            "ttft_mean_s": mean_ttft, "raw_forward_of_computed_s": raw,
            "ttft_over_raw_forward": mean_ttft / raw if raw and mean_ttft is not None else None,
            "ttft_over_prefix_bound": (mean_ttft / prefix["ttft_bound_s"]
                                       if prefix["ttft_bound_s"] and mean_ttft is not None else None),
        })
    per_request = {"prompt_tokens": list(served_prompt),
                   **{n: (list(c.reused) if c is not None else None) for n, c in bounds.by_name().items()}}
    return {
        "trace": dict(info), "bounds": rows, "reached": reached,
        "passage_bound": bounds.passages.as_dict() if bounds.passages is not None else None,
        "raw_forward": fit.as_dict() if fit is not None else None, "stored_tokens": bounds.stored_tokens,
        "blend": blend_section(runs, rows, fit, served_prompt),
        "per_request": per_request, "notes": list(notes),
    }


_TIER_NAMES = ("device", "dram", "ssd", "remote")


def reuse_split(run: Mapping[str, Any]) -> dict[str, float | None]:
    """A run's reuse as fractions of its prompt tokens: ``exact`` (the prefix), ``blended`` (placed tokens as the
    engine counts them), ``blended_reused`` (placed from KV an earlier request left), ``blended_fresh`` (placed
    after an isolated prefill for their own request: not reuse) and ``reuse`` = exact + blended_reused (None when
    the bench could not replay some request's plan)."""
    tokens = run.get("tokens") or {}
    prompt = tokens.get("prompt") or 0
    exact = run.get("reuse_ratio")
    if "blended" not in tokens:  # nothing placed
        return {"reuse": exact, "exact": exact, "blended": 0.0, "blended_reused": 0.0, "blended_fresh": 0.0}
    if not prompt:
        return {"reuse": None, "exact": exact, "blended": None, "blended_reused": None, "blended_fresh": None}
    fresh, reused = tokens.get("blended_fresh"), tokens.get("blended_reused")
    return {"reuse": None if reused is None or exact is None else exact + reused / prompt, "exact": exact,
            "blended": tokens["blended"] / prompt, "blended_reused": None if reused is None else reused / prompt,
            "blended_fresh": None if fresh is None else fresh / prompt}


def raw_forward_seconds(run: Mapping[str, Any], fit: RawForwardFit) -> list[float]:
    """Per request of ``run``: one raw forward (``fit``) of exactly the tokens it computed, against the same
    context. An exact request computes the suffix after its reused prefix; a blend request the spans its ledger
    replayed (`pcr_rag.bench.blend_ledger`: in context, and its fresh documents at their prompt positions), from
    the ``compute_context`` column. At least one token: the first output token needs logits."""
    req = run.get("requests") or {}
    p_tok = list(req.get("prompt_tokens") or [])
    n = len(p_tok)
    reused = [sum(v) for v in zip(*(req.get(f"reused_{t}") or [0] * n for t in _TIER_NAMES), strict=True)]
    blended = list(req.get("blended") or [0] * n)
    placed_reuse = list(req.get("blended_reused") or [None] * n)
    context = list(req.get("compute_context") or [None] * n)
    out = []
    for p, r, b, pr, c in zip(p_tok, reused, blended, placed_reuse, context, strict=True):
        if c is not None and pr is not None:
            out.append(fit.seconds_at(max(1, p - r - pr), c))
        else:  # no replayed plan: the engine's placed tokens as reused, the rest as one suffix
            computed = max(1, p - r - b)
            out.append(fit.seconds(computed, p - computed))
    return out


def _table(run: Mapping[str, Any], column: str, values: Sequence[float] | None = None) -> RequestTable | None:
    """``run``'s requests as a `RequestTable` whose ``ttft`` column is ``column`` (or ``values``, one per request),
    for paired intervals of two columns of one run."""
    req = run.get("requests") or {}
    col = list(values) if values is not None else list(req.get(column) or [])
    if not col or any(v is None for v in col):
        return None
    return RequestTable.from_run({"requests": {"ttft": col, "key": req.get("key") or [[0, i] for i in range(len(col))]}})


def _interval(ci: RatioInterval | None) -> dict[str, Any] | None:
    return None if ci is None else {"ratio": ci.ratio, "low": ci.low, "high": ci.high, "n": ci.n}


def blend_section(runs: Sequence[Mapping[str, Any]], rows: Mapping[str, Any], fit: RawForwardFit | None,
                  served_prompt: Sequence[int]) -> list[dict[str, Any]]:
    """Per blend run (one whose tokens carry ``blended``) of a replay: its reuse against the position-independent
    bound, its limit ratio (mean TTFT over a raw forward of exactly the tokens it computed, with a paired
    interval; also with prefill time instead of TTFT, which leaves queueing out, and with the time of its own
    prefill steps, which also leaves out other requests' steps run between them), its mean TTFT over exact pcr's
    and no-reuse's (paired intervals over the same requests), each against its ``BLEND_*`` target, and what its
    cost is made of: the attention share of a full prefill at the replay's mean prompt length (the raw-forward
    fit's context term), compute spans per request (runs of computed positions between placed documents) and the
    fit's fixed cost of one forward, queueing."""
    by_name = {r["system"]: r for r in runs}
    pi = (rows.get("position_independent") or {}).get("fraction")
    out: list[dict[str, Any]] = []
    for run in runs:
        if "blended" not in (run.get("tokens") or {}):
            continue
        split = reuse_split(run)
        req = run.get("requests") or {}
        raws = raw_forward_seconds(run, fit) if fit is not None else None
        limit = limit_prefill = limit_own = None
        if raws:
            raw_table = _table(run, "ttft", raws)
            tables = [_table(run, col) for col in ("ttft", "prefill", "prefill_compute")]
            if raw_table is not None:
                limit, limit_prefill, limit_own = (None if t is None else
                                                   paired_ratio_interval(t, raw_table, "ttft.mean") for t in tables)
        vs_pcr = _run_ratio(run, by_name.get("pcr"))
        vs_none = _run_ratio(run, by_name.get("no-reuse"))
        over_pi = split["reuse"] / pi if pi and split["reuse"] is not None else None
        spans = [s for s in req.get("compute_spans") or [] if s is not None]
        ttft = (run.get("ttft") or {}).get("mean")
        queue = (run.get("queue") or {}).get("mean")
        mean_prompt = statistics.mean(served_prompt) if served_prompt else 0
        out.append({
            "system": run["system"], "recompute": (run.get("extra") or {}).get("blend_recompute"),
            "reuse": split, "position_independent_bound": pi, "reuse_over_position_independent": over_pi,
            "limit_ratio": _interval(limit), "limit_ratio_prefill": _interval(limit_prefill),
            "limit_ratio_own_compute": _interval(limit_own),
            "raw_forward_mean_s": statistics.mean(raws) if raws else None,
            "ttft_vs_pcr": _interval(vs_pcr), "ttft_vs_no_reuse": _interval(vs_none),
            "attention_share_full_prefill": fit.attention_share(round(mean_prompt)) if fit is not None else None,
            "mean_prompt_tokens": mean_prompt,
            "compute_spans_mean": statistics.mean(spans) if spans else None,
            "fixed_s_per_forward": fit.fixed_s if fit is not None else None,
            "queue_share_of_ttft": queue / ttft if ttft and queue is not None else None,
            "inconsistent_requests": (run.get("extra") or {}).get("blend_inconsistent"),
            "ssd_evictions": (run.get("extra") or {}).get("ssd_evictions"),
            "targets": {
                "reuse_over_position_independent": _verdict(over_pi, BLEND_MIN_REUSE_OVER_POSITION_INDEPENDENT,
                                                            at_least=True),
                "limit_ratio": _verdict(limit, BLEND_LIMIT_RATIO_MAX),
                "ttft_vs_pcr": _verdict(vs_pcr, BLEND_VS_PCR_MEAN_TTFT_MAX),
            },
        })
    return out


def _run_ratio(run: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> RatioInterval | None:
    """Mean TTFT of ``run`` over ``baseline``'s on the same requests, with its paired interval."""
    if baseline is None:
        return None
    a, b = RequestTable.from_run(run), RequestTable.from_run(baseline)
    return None if a is None or b is None else paired_ratio_interval(a, b, "ttft.mean")


def _verdict(value: float | RatioInterval | None, bound: float, *, at_least: bool = False) -> dict[str, Any]:
    """A target's verdict: ``passed`` on the interval's unfavourable end (the upper one for an upper bound), or on
    the value itself when it has no interval; None when not measured."""
    if value is None:
        return {"bound": bound, "at_least": at_least, "value": None, "passed": None}
    if isinstance(value, RatioInterval):
        judged, point = (value.low if at_least else value.high), value.ratio
    else:
        judged = point = value
    return {"bound": bound, "at_least": at_least, "value": point,
            "passed": bool(judged >= bound if at_least else judged <= bound)}


def _pct(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _ms(x: Any) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def _times(x: Any) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _ci(row: Mapping[str, Any] | None) -> str:
    return "n/a" if row is None else f"{row['ratio']:.2f}x [{row['low']:.2f}, {row['high']:.2f}]"


def _verdict_text(v: Mapping[str, Any]) -> str:
    mark = {True: "PASS", False: "MISS", None: "NOT RUN"}[v.get("passed")]
    return f"{mark} ({'>=' if v.get('at_least') else '<='} {v['bound']:g})"


def blend_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines of a replay's ``blend`` section (`blend_section`); none without a blend run."""
    if not rows:
        return []
    lines = ["### Blend mode against its targets (95% paired bootstrap intervals)", "",
             "| system | reused / position-independent bound | limit ratio (TTFT / raw forward of its computed tokens) "
             "| same, prefill only | same, its own prefill steps only | TTFT / pcr | TTFT / no-reuse |",
             "|---|---|---|---|---|---|---|"]
    for b in rows:
        t = b["targets"]
        over = b.get("reuse_over_position_independent")
        lines.append(f"| {b['system']} | {_times(over)} {_verdict_text(t['reuse_over_position_independent'])} "
                     f"| {_ci(b['limit_ratio'])} {_verdict_text(t['limit_ratio'])} | {_ci(b['limit_ratio_prefill'])} "
                     f"| {_ci(b.get('limit_ratio_own_compute'))} "
                     f"| {_ci(b['ttft_vs_pcr'])} {_verdict_text(t['ttft_vs_pcr'])} | {_ci(b['ttft_vs_no_reuse'])} |")
    lines.append("")
    for b in rows:
        r = b["reuse"]
        parts = [f"exact {_pct(r['exact'])}, placed from KV an earlier request left {_pct(r['blended_reused'])}, "
                 f"placed after an isolated prefill for the request itself {_pct(r['blended_fresh'])} (the engine "
                 f"counts {_pct(r['blended'])} as blended)"]
        if b.get("attention_share_full_prefill") is not None:
            parts.append(f"attention over the context is {_pct(b['attention_share_full_prefill'])} of a full prefill "
                         f"of the mean prompt ({b['mean_prompt_tokens']:.0f} tokens; the raw-forward fit's context "
                         "term)")
        if b.get("compute_spans_mean") is not None and b.get("fixed_s_per_forward") is not None:
            parts.append(f"{b['compute_spans_mean']:.1f} compute spans per request (the runs of computed positions "
                         f"between placed documents); a raw forward's fixed cost is {_ms(b['fixed_s_per_forward'])} "
                         "(raw-forward fit)")
        if b.get("queue_share_of_ttft") is not None:
            parts.append(f"queueing {_pct(b['queue_share_of_ttft'])} of its TTFT")
        if b.get("inconsistent_requests"):
            parts.append(f"{b['inconsistent_requests']} requests whose blend plan the bench could not replay "
                         "(their placed tokens count as reused)")
        if b.get("ssd_evictions"):
            parts.append(f"{b['ssd_evictions']} chunks left the SSD tier (a document's KV evicted and recomputed "
                         "still counts as reused here)")
        lines.append(f"- {b['system']}: " + "; ".join(parts) + ".")
    lines.append("")
    return lines


def bounds_markdown(section: Mapping[str, Any]) -> list[str]:
    """Markdown lines of a report's ``bounds`` section (`bounds_section`)."""
    info = section.get("trace") or {}
    lines = ["## Trace replay: reuse bounds vs what each system reached", ""]
    if info:
        lines += ["Trace: " + ", ".join(f"`{k}={v}`" for k, v in info.items() if not isinstance(v, (dict, list))),
                  ""]
    lines += ["Fractions of all prompt tokens of the replayed requests (engine layout, chunk granularity, a cache "
              "that never evicts); TTFT bound: mean raw forward of only the tokens each request must compute.", "",
              "| bound | reused | computed tokens / request | TTFT bound |", "|---|---|---|---|"]
    for name, row in (section.get("bounds") or {}).items():
        if row is None:
            lines.append(f"| {BOUND_LABELS.get(name, name)} | n/a | n/a | n/a |")
            continue
        lines.append(f"| {row['label']} | {_pct(row['fraction'])} | {row['computed_tokens_mean']:.0f} "
                     f"| {_ms(row['ttft_bound_s'])} |")
    lines += ["", "Reused: exact prefix + placed tokens whose KV an earlier request left (blend mode); placed tokens "
              "computed in isolation for their own request (a document's first use) are not reuse.", "",
              "| system | reused | exact | blended from earlier KV | blended, fresh | / prefix bound "
              "| / position-independent bound | TTFT mean | raw forward of what it computed | TTFT / raw "
              "| TTFT / prefix TTFT bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in section.get("reached") or []:
        lines.append(f"| {r['system']} | {_pct(r['reuse'])} | {_pct(r.get('exact_reuse', r['reuse']))} "
                     f"| {_pct(r.get('blended_reused'))} | {_pct(r.get('blended_fresh'))} "
                     f"| {_times(r['reuse_over_prefix_bound'])} "
                     f"| {_times(r.get('reuse_over_position_independent_bound'))} "
                     f"| {_ms(r['ttft_mean_s'])} | {_ms(r['raw_forward_of_computed_s'])} "
                     f"| {_times(r['ttft_over_raw_forward'])} | {_times(r['ttft_over_prefix_bound'])} |")
    lines.append("")
    lines += blend_markdown(section.get("blend") or [])
    differ = [r["system"] for r in section.get("reached") or [] if r.get("prompt_tokens_as_laid_out") is False]
    if differ:
        lines += [f"Prompt tokens of {', '.join(differ)} differ from the layout the bounds were computed on "
                  "(an outside baseline tokenizes its own prompt).", ""]
    pb = section.get("passage_bound")
    if pb:
        lines += [f"Passage tokens alone (moved layout): relevance order {_pct(pb['relevance'])}, cache-aware order "
                  f"{_pct(pb['cache_aware'])} ({pb['reordered']} of {pb['requests']} requests reordered).", ""]
    fit = section.get("raw_forward")
    if fit:
        lines += [f"Raw forward fit: {fit['fixed_s'] * 1000:.1f} ms + {fit['per_token_s'] * 1e6:.0f} us/token + "
                  f"{fit['per_token_context_s'] * 1e9:.2f} ns/token/context token, from "
                  f"{len(fit['points'])} timed forwards.", ""]
    lines += [f"- {n}" for n in section.get("notes") or []]
    if section.get("notes"):
        lines.append("")
    return lines
