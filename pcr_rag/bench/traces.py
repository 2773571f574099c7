"""The traces of a ``pcr-rag bench`` run, built from its config alone (so ``pcr-rag simulate --validate`` can
rebuild the exact requests of a finished run).

corpus -> passages (cut with the model's tokenizer) -> a seeded pool of passages -> one warm-up trace and one
measured trace per (repeat, rate slot), all sharing one popularity ranking -> exact token counts from the engine's
own prompt layout -> the working set (bytes of KV) the tier capacities are sized from.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig, BenchError
from pcr_rag.bench.retrieval import load_questions, retrieve_topics
from pcr_rag.bench.workload import Request, make_requests, popular_topics, with_rate, working_set
from pcr_rag.corpus import CorpusDocument, load_corpus, split_passages
from pcr_rag.prompt import PromptBuilder

log = logging.getLogger(__name__)

__all__ = ["BenchTraces", "build_traces"]


@dataclass(frozen=True)
class BenchTraces:
    """Everything the systems of one run are fed, the same for all of them.

    ``unit_traces[(repeat, slot)]``: the measured trace of a rate slot with arrival times for 1 req/s (scale with
    `pcr_rag.bench.workload.with_rate`). ``doc_tokens``: tokens of each passage's prompt segment (with its
    separators); ``system_tokens``: the shared first segment; ``suffix_tokens``: the question parts of all
    requests together. ``ws_bytes``: KV bytes of the working set; ``ws_info``: its summary for the report.
    """

    passages: dict[str, CorpusDocument]
    warmup: list[Request]
    unit_traces: dict[tuple[int, int], list[Request]]
    doc_tokens: dict[str, int]
    system_tokens: int
    suffix_tokens: int
    ws_bytes: int
    ws_info: dict[str, Any]

    def documents(self, request: Request) -> list[str]:
        """The texts of a request's passages, in its retrieval order."""
        return [self.passages[d].text for d in request.doc_ids]


def build_traces(cfg: BenchConfig, tokenizer: Any, kv_bytes_per_token: int) -> BenchTraces:
    """Build the run's traces (see the module docstring). Deterministic for the same config and tokenizer."""
    docs = load_corpus(cfg.corpus, max_docs=cfg.max_docs)
    passages = split_passages(docs, tokens_per_passage=cfg.tokens_per_passage, tokenizer=tokenizer)
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
    topics = retrieve_topics(passages, load_questions(cfg.questions), cfg.top_k) if cfg.retrieval else None

    def trace(seed: int, n: int) -> list[Request]:
        return make_requests(ids, num_requests=n, top_k=cfg.top_k, zipf_exponent=cfg.zipf_exponent,
                             rate=1.0, burstiness=cfg.burstiness, seed=seed, titles=titles,
                             popularity_seed=cfg.seed, num_topics=None if topics else cfg.num_topics,
                             topics=topics)

    warmup = _warmup_trace(cfg, ids, topics, trace)
    unit = {(rep, i): trace(cfg.seed * 1000 + rep * 100 + i, cfg.num_requests)
            for rep in range(cfg.repeats) for i in range(len(cfg.rate_slots))}
    # Exact token counts from the engine's own prompt layout: segment 0 = system + instruction,
    # segments 1..k = documents (with their separators), the rest = the question part.
    builder = PromptBuilder(tokenizer)
    doc_tokens: dict[str, int] = {}
    system_tokens = 0
    suffix = 0
    all_reqs = warmup + [r for t in unit.values() for r in t]
    for req in all_reqs:
        seg = builder.build_rag(req.question, [by_id[d].text for d in req.doc_ids], SYSTEM_PROMPT)
        system_tokens = max(system_tokens, len(seg.segments[0]))
        for d, s in zip(req.doc_ids, seg.segments[1:1 + len(req.doc_ids)], strict=False):
            doc_tokens[d] = max(doc_tokens.get(d, 0), len(s))
        suffix += sum(len(s) for s in seg.segments[1 + len(req.doc_ids):])
    ws = working_set(all_reqs, doc_tokens, bytes_per_token=kv_bytes_per_token, system_tokens=system_tokens,
                     suffix_tokens=suffix)
    ws_info = {**asdict(ws), "reuse_upper_bound": ws.reuse_upper_bound, "passages": len(passages),
               "requests": len(all_reqs),
               "mean_prompt_tokens": (ws.requested_tokens + suffix) / len(all_reqs) + system_tokens}
    log.info("working set: %d passages touched, %d prefix tokens, %.1f MiB of KV, reuse bound %.0f%%",
             ws.unique_docs, ws.prefix_tokens, ws.bytes / 2**20, 100 * ws.reuse_upper_bound)
    return BenchTraces(by_id, warmup, unit, doc_tokens, system_tokens, suffix, ws.bytes, ws_info)


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
