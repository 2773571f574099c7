"""The traces of a ``pcr-rag bench`` run, built from its config alone (so ``pcr-rag simulate --validate`` can
rebuild the exact requests of a finished run).

corpus -> passages (cut with the model's tokenizer) -> a seeded pool of passages -> (``retrieval``) questions
from a file or generated from the corpus's own titles, with their top-k passages -> one warm-up trace, one
measured trace per (repeat, rate slot) and one saturation trace per repeat, all sharing one popularity ranking
-> the cache-aware document order of every request and the reuse bound of both orders
(`pcr_rag.bench.reorder`) -> exact token counts from the engine's own prompt layout -> the working set (bytes of
KV) the tier capacities are sized from.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig, BenchError
from pcr_rag.bench.reorder import ReuseBound, order_trace
from pcr_rag.bench.retrieval import TitleQuestion, hit_at_k, load_questions, retrieve_topics, title_questions
from pcr_rag.bench.workload import Request, make_requests, popular_topics, with_rate, working_set
from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.prompt import PromptBuilder
from pcr_rag.rag.corpus import CorpusDocument, load_corpus, section_titles, split_passages

log = logging.getLogger(__name__)

__all__ = ["BenchTraces", "build_traces"]


@dataclass(frozen=True)
class BenchTraces:
    """Everything the systems of one run are fed, the same for all of them.

    ``unit_traces[(repeat, slot)]``: the measured trace of a rate slot with arrival times for 1 req/s (scale with
    `pcr_rag.bench.workload.with_rate`); ``saturation[repeat]``: the saturation trace (all at once).
    ``doc_tokens``: tokens of each passage's prompt segment (with its separators); ``system_tokens``: the shared
    first segment; ``suffix_tokens``: the question parts of all requests together. ``ws_bytes``: KV bytes of the
    working set; ``ws_info``: its summary for the report. ``cache_aware``: request -> its documents in offline
    cache-aware order (`pcr_rag.bench.reorder.order_trace`), keyed by ``(trace name, request id)``;
    ``reuse_bound``: the trace's reuse bound in both orders. ``gold``: topic index -> its generated question
    (gold passage, asked-about name), for generated questions; ``hit_at_k``: the share of topics whose gold
    passage was retrieved.
    """

    passages: dict[str, CorpusDocument]
    warmup: list[Request]
    unit_traces: dict[tuple[int, int], list[Request]]
    doc_tokens: dict[str, int]
    system_tokens: int
    suffix_tokens: int
    ws_bytes: int
    ws_info: dict[str, Any]
    saturation: dict[int, list[Request]] = field(default_factory=dict)
    cache_aware: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    reuse_bound: ReuseBound | None = None
    gold: dict[int, TitleQuestion] = field(default_factory=dict)
    hit_at_k: float | None = None

    def documents(self, request: Request) -> list[str]:
        """The texts of a request's passages, in its (retrieval) order."""
        return [self.passages[d].text for d in request.doc_ids]

    def in_order(self, trace_name: str, trace: Sequence[Request], order: str) -> list[Request]:
        """``trace`` with each request's documents in ``order``: ``relevance`` (as retrieved) or ``cache-aware``
        (the offline order); ``trace_name`` is ``"warmup"``, ``"slot-R-I"`` or ``"saturation-R"``."""
        if order == "relevance":
            return list(trace)
        return [replace(r, doc_ids=self.cache_aware.get((trace_name, r.request_id), r.doc_ids)) for r in trace]


def _trace_names(cfg: BenchConfig) -> list[str]:
    """Trace names in service order: warm-up, then per repeat the rate slots and the saturation trace."""
    names = ["warmup"]
    for rep in range(cfg.repeats):
        names += [f"slot-{rep}-{i}" for i in range(len(cfg.rate_slots))]
        if cfg.saturation:
            names.append(f"saturation-{rep}")
    return names


def build_traces(cfg: BenchConfig, tokenizer: Any, kv_bytes_per_token: int) -> BenchTraces:
    """Build the run's traces (see the module docstring). Deterministic for the same config and tokenizer."""
    docs = load_corpus(cfg.corpus, max_docs=cfg.max_docs)
    all_passages = split_passages(docs, tokens_per_passage=cfg.tokens_per_passage, tokenizer=tokenizer)
    passages = all_passages
    if cfg.num_passages is not None and cfg.num_passages < len(passages):
        rng = np.random.default_rng([cfg.seed, 7])
        keep = sorted(rng.choice(len(passages), size=cfg.num_passages, replace=False).tolist())
        passages = [passages[i] for i in keep]
    if len(passages) < cfg.top_k:
        raise BenchError(f"the corpus has {len(passages)} passages but top_k={cfg.top_k}; use a larger corpus "
                         "or a smaller --top-k")
    by_id = {p.doc_id: p for p in passages}
    ids = list(by_id)
    titles = {p.doc_id: p.title.split(" (part")[0] for p in passages}
    topics: list[tuple[str, tuple[str, ...]]] | None = None
    gold: dict[int, TitleQuestion] = {}
    hit = None
    if cfg.retrieval:
        if cfg.questions is not None:
            questions = load_questions(cfg.questions)
        else:
            generated = _generated_questions(cfg, all_passages, by_id)
            gold = dict(enumerate(generated))
            questions = [q.question for q in generated]
        topics = retrieve_topics(passages, questions, cfg.top_k)
        hit = hit_at_k(topics, [gold[i].gold if i in gold else None for i in range(len(topics))])

    def trace(seed: int, n: int) -> list[Request]:
        return make_requests(ids, num_requests=n, top_k=cfg.top_k, zipf_exponent=cfg.zipf_exponent,
                             rate=1.0, burstiness=cfg.burstiness, seed=seed, titles=titles,
                             popularity_seed=cfg.seed, num_topics=None if topics else cfg.num_topics,
                             topics=topics)

    warmup = _warmup_trace(cfg, ids, topics, trace)
    unit = {(rep, i): trace(cfg.seed * 1000 + rep * 100 + i, cfg.num_requests)
            for rep in range(cfg.repeats) for i in range(len(cfg.rate_slots))}
    saturation = {rep: with_rate(trace(cfg.seed * 1000 + rep * 100 + 99, cfg.saturation_size), math.inf)
                  for rep in range(cfg.repeats)} if cfg.saturation else {}
    # Exact token counts from the engine's own prompt layout: segment 0 = system + instruction,
    # segments 1..k = documents (with their separators), the rest = the question part.
    builder = PromptBuilder(tokenizer)
    doc_tokens: dict[str, int] = {}
    system_tokens = 0
    suffix = 0
    all_reqs = warmup + [r for t in unit.values() for r in t] + [r for t in saturation.values() for r in t]
    for req in all_reqs:
        seg = builder.build_rag(req.question, [by_id[d].text for d in req.doc_ids], SYSTEM_PROMPT)
        system_tokens = max(system_tokens, len(seg.segments[0]))
        for d, s in zip(req.doc_ids, seg.segments[1:1 + len(req.doc_ids)], strict=False):
            doc_tokens[d] = max(doc_tokens.get(d, 0), len(s))
        suffix += sum(len(s) for s in seg.segments[1 + len(req.doc_ids):])
    ws = working_set(all_reqs, doc_tokens, bytes_per_token=kv_bytes_per_token, system_tokens=system_tokens,
                     suffix_tokens=suffix)
    cache_aware, bound = _cache_aware_orders(cfg, builder, by_id, warmup, unit, saturation)
    ws_info = {**asdict(ws), "reuse_upper_bound": ws.reuse_upper_bound, "passages": len(passages),
               "requests": len(all_reqs),
               "mean_prompt_tokens": (ws.requested_tokens + suffix) / len(all_reqs) + system_tokens,
               "reuse_bound_by_order": {"relevance": bound.relevance, "cache-aware": bound.cache_aware},
               "reordered_requests": bound.reordered}
    if topics is not None:
        ws_info.update(questions=len(topics), generated_questions=bool(gold), hit_at_k=hit)
    log.info("working set: %d passages touched, %d prefix tokens, %.1f MiB of KV, reuse bound %.0f%% "
             "(relevance order, chunk level %.0f%%; cache-aware order %.0f%%)", ws.unique_docs, ws.prefix_tokens,
             ws.bytes / 2**20, 100 * ws.reuse_upper_bound, 100 * bound.relevance, 100 * bound.cache_aware)
    return BenchTraces(by_id, warmup, unit, doc_tokens, system_tokens, suffix, ws.bytes, ws_info, saturation,
                       cache_aware, bound, gold, hit)


def _generated_questions(cfg: BenchConfig, all_passages: Sequence[CorpusDocument],
                         pool: dict[str, CorpusDocument]) -> list[TitleQuestion]:
    """Questions from the titles of the pool's passages (the section context comes from all passages)."""
    titles = [t for t in section_titles(all_passages) if t.passage_id in pool]
    if not titles:
        raise BenchError("the corpus carries no titles to generate questions from (pydoc entries or Markdown "
                         "headings); pass --questions FILE with one question per line")
    questions = title_questions(titles, limit=cfg.num_questions)
    if len(questions) < cfg.num_questions:
        log.info("%d questions generated from the corpus's titles (asked for up to %d)", len(questions),
                 cfg.num_questions)
    return questions


def _cache_aware_orders(cfg: BenchConfig, builder: PromptBuilder, by_id: dict[str, CorpusDocument],
                        warmup: list[Request], unit: dict[tuple[int, int], list[Request]],
                        saturation: dict[int, list[Request]]
                        ) -> tuple[dict[tuple[str, int], tuple[str, ...]], ReuseBound]:
    """Every request's offline cache-aware order (its trace name and id -> doc ids) and the reuse bound of both
    orders, walking the traces in the order a system serves them. The chunk plan is the engine's own
    (`PCREngine.plan_for`: the `PromptBuilder` segments cut by `plan_chunks`), under a fixed root key."""
    root = namespace_key("bench-order", "any", cfg.chunk_size)

    def plan(question: str, documents: Sequence[str]) -> Sequence[Any]:
        return plan_chunks(root, builder.build_rag(question, documents, SYSTEM_PROMPT).segments, cfg.chunk_size)

    traces: dict[str, list[Request]] = {"warmup": warmup}
    for name in _trace_names(cfg)[1:]:
        kind, _, rest = name.partition("-")
        if kind == "slot":
            rep, i = (int(x) for x in rest.split("-"))
            traces[name] = unit[(rep, i)]
        else:
            traces[name] = saturation[int(rest)]
    items = [(name, r) for name, t in traces.items() for r in sorted(t, key=lambda r: (r.arrival_s, r.request_id))]
    orders, bound = order_trace([(r.question, [by_id[d].text for d in r.doc_ids]) for _, r in items], plan)
    reordered = {(name, r.request_id): tuple(r.doc_ids[i] for i in perm)
                 for (name, r), perm in zip(items, orders, strict=True)}
    return reordered, bound


def _warmup_trace(cfg: BenchConfig, ids: list[str], topics: Sequence[tuple[str, Sequence[str]]] | None,
                  trace: Callable[[int, int], list[Request]]) -> list[Request]:
    """Warm the caches with the popular content: in topic mode the ``warmup_requests`` most popular topics,
    least popular first (so the most popular end up most recently used); else a random trace. All at t=0."""
    if not cfg.warmup_requests:
        return []
    pop = popular_topics(ids, top_k=cfg.top_k, zipf_exponent=cfg.zipf_exponent, popularity_seed=cfg.seed,
                         num_topics=None if topics else cfg.num_topics, topics=topics)
    if not pop:
        return with_rate(trace(cfg.seed * 1000 + 999, cfg.warmup_requests), math.inf)
    chosen = list(reversed(pop[:cfg.warmup_requests]))
    return [Request(i, 0.0, docs, f"Warm-up {i}: {question or 'What do these documents describe?'}", t)
            for i, (t, docs, question) in enumerate(chosen)]
