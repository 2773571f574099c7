"""Seeded, reproducible RAG request traces: which documents each request carries, and when it arrives.

* Document choice: Zipf-skewed popularity over the passages (``P(rank r) ∝ r^-s``, ``s = zipf_exponent``; the
  popularity ranking is a seeded permutation of the passages, so "popular" is not "first in the corpus"); a
  retrieval list is ``top_k`` distinct passages drawn without replacement, in draw order (popular passages tend
  to come first, like a relevance-ranked list).

  - ``num_topics=None`` ("passages" mode): every request draws its own list.
  - ``num_topics=T`` ("topics" mode): T topics each get one fixed list; a request picks a topic with Zipf
    popularity (same exponent) and asks a new question about it. This is how RAG traffic repeats in practice
    (popular questions retrieve the same ranked documents), and what a prefix cache can reuse: chunk keys chain
    across documents, so only identical leading documents share KV.

  Or the caller gives retrieval results (question, doc ids): :func:`requests_from_retrieval`.
* Arrivals: a Poisson process at ``rate`` requests/s, optionally bursty: inter-arrival times are
  Gamma(shape=burstiness, scale=1/(rate*burstiness)) like vLLM's ``--burstiness`` (1.0 = Poisson, < 1 burstier,
  > 1 more regular; the mean stays 1/rate). ``rate=inf`` sends everything at t=0. The first request arrives at 0.
* Working set: the KV a prefix-tree cache must hold to serve the trace with no misses but the first touch.
  Chunk keys chain across documents, so document ``d`` after ``[a]`` and after ``[b]`` are different cache
  entries: the working set counts each distinct document *prefix* once (see :func:`working_set`).

Everything here is pure Python + numpy and deterministic for a given seed; time is seconds, sizes tokens/bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "QUESTION_TEMPLATES",
    "Request",
    "WorkingSet",
    "arrival_times",
    "make_requests",
    "popular_topics",
    "requests_from_retrieval",
    "tier_capacities",
    "with_rate",
    "working_set",
    "zipf_weights",
]

#: Question templates; ``{title}`` is the title of the request's first document, ``{n}`` the request number (so
#: every question, hence every prompt suffix, is distinct and never served from the cache).
QUESTION_TEMPLATES: tuple[str, ...] = (
    "Request {n}: In one sentence, what is {title} used for?",
    "Request {n}: Name one function or class described in {title} and what it does.",
    "Request {n}: What would a beginner most likely get wrong when using {title}?",
    "Request {n}: Summarise the documentation of {title} in a few words.",
    "Request {n}: Which argument of {title} is the most important, and why?",
)


@dataclass(frozen=True)
class Request:
    """One RAG request of a trace: ``arrival_s`` seconds after the trace starts, with its documents in order.
    ``max_new_tokens``: this request's output tokens at most (a replayed trace's ``output_length``); None: the
    run's ``BenchConfig.max_new_tokens``."""

    request_id: int
    arrival_s: float
    doc_ids: tuple[str, ...]
    question: str
    topic: int | None = None
    max_new_tokens: int | None = None


def zipf_weights(n: int, exponent: float = 1.0) -> np.ndarray:
    """Normalised Zipf probabilities for ranks 1..n: ``p[r-1] ∝ r^-exponent`` (exponent 0 = uniform)."""
    if n < 1:
        raise ValueError(f"need at least one item for a Zipf distribution, got n={n}")
    if exponent < 0:
        raise ValueError(f"zipf exponent must be >= 0, got {exponent}")
    w = np.arange(1, n + 1, dtype=np.float64) ** -float(exponent)
    return w / w.sum()


def arrival_times(
    num_requests: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    rng: np.random.Generator | int | None = 0,
) -> list[float]:
    """Arrival times (seconds, non-decreasing, first = 0) of ``num_requests`` requests at ``rate`` req/s.

    ``rate=math.inf`` -> all zeros. Otherwise inter-arrival gaps ~ Gamma(burstiness, 1/(rate*burstiness)), whose
    mean is 1/rate; burstiness 1.0 is a Poisson process.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (math.inf = all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    gaps = gen.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def make_requests(
    doc_ids: Sequence[str],
    *,
    num_requests: int,
    top_k: int = 3,
    zipf_exponent: float = 1.0,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    titles: Mapping[str, str] | None = None,
    popularity_seed: int | None = None,
    num_topics: int | None = None,
    topics: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> list[Request]:
    """A seeded trace of ``num_requests`` requests over the passages ``doc_ids`` (see the module docstring).

    ``popularity_seed`` fixes which passages (and topics, with their document lists) are popular independently
    of ``seed`` (default: ``seed``), so several traces (e.g. one per request rate) share one popularity ranking
    and one set of topics while drawing different requests. Same arguments -> the same list, on any machine.

    ``topics``: given (question, ranked doc ids) pairs, e.g. from real retrieval
    (`pcr_rag.bench.retrieval.retrieve_topics`), used instead of drawn lists: requests pick them with Zipf
    popularity (over a seeded permutation) and ask ``"Request <n>: <question>"``. Excludes ``num_topics``.
    """
    if topics is not None:
        return _requests_over_topics(topics, num_requests, zipf_exponent, rate, burstiness, seed,
                                     seed if popularity_seed is None else popularity_seed, num_topics)
    ids = list(doc_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("doc_ids must be unique")
    if not 1 <= top_k <= len(ids):
        raise ValueError(f"top_k must be in [1, {len(ids)}] (number of passages), got {top_k}")
    if num_topics is not None and num_topics < 1:
        raise ValueError(f"num_topics must be >= 1 (or None for per-request draws), got {num_topics}")
    ranked, p, drawn = _drawn_topics(ids, top_k, zipf_exponent,
                                      seed if popularity_seed is None else popularity_seed, num_topics)

    def draw(gen: np.random.Generator) -> tuple[str, ...]:
        return tuple(ranked[i] for i in gen.choice(len(ranked), size=top_k, replace=False, p=p))

    topic_p = zipf_weights(num_topics, zipf_exponent) if num_topics is not None else None
    rng = np.random.default_rng([seed, 1])
    arrivals = arrival_times(num_requests, rate, burstiness=burstiness, rng=np.random.default_rng([seed, 2]))
    requests: list[Request] = []
    for n in range(num_requests):
        topic: int | None = None
        if topic_p is not None:
            topic = int(rng.choice(len(drawn), p=topic_p))
            chosen = drawn[topic]
        else:
            chosen = draw(rng)
        template = QUESTION_TEMPLATES[int(rng.integers(len(QUESTION_TEMPLATES)))]
        title = (titles or {}).get(chosen[0], chosen[0])
        requests.append(Request(n, arrivals[n], chosen, template.format(n=n, title=title), topic))
    return requests


def _drawn_topics(ids: Sequence[str], top_k: int, zipf_exponent: float, popularity_seed: int,
                  num_topics: int | None) -> tuple[list[str], np.ndarray, list[tuple[str, ...]]]:
    """The popularity ranking of passages, its Zipf weights, and (topic mode) the topics' lists; topic i has
    popularity rank i. Depends only on its arguments (the popularity seed), never on the request seed."""
    pop_rng = np.random.default_rng(popularity_seed)
    ranked = [ids[i] for i in pop_rng.permutation(len(ids))]  # ranked[0] is the most popular passage
    p = zipf_weights(len(ranked), zipf_exponent)
    topics = [tuple(ranked[i] for i in pop_rng.choice(len(ranked), size=top_k, replace=False, p=p))
              for _ in range(num_topics or 0)]
    return ranked, p, topics


def _topic_order(num_topics: int, popularity_seed: int) -> np.ndarray:
    """Given topics: ``order[r]`` is the index of the topic with popularity rank r (0 = most popular)."""
    return np.random.default_rng([popularity_seed, 3]).permutation(num_topics)


def popular_topics(
    doc_ids: Sequence[str],
    *,
    top_k: int = 3,
    zipf_exponent: float = 1.0,
    popularity_seed: int = 0,
    num_topics: int | None = None,
    topics: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> list[tuple[int, tuple[str, ...], str | None]]:
    """The topics of a trace made with the same arguments by :func:`make_requests`, most popular first:
    ``(topic index, doc ids, question or None)``. Empty in passages mode (no topics)."""
    if topics is not None:
        return [(int(t), tuple(topics[t][1]), topics[t][0]) for t in _topic_order(len(topics), popularity_seed)]
    if num_topics is None:
        return []
    _, _, drawn = _drawn_topics(list(doc_ids), top_k, zipf_exponent, popularity_seed, num_topics)
    return [(i, lst, None) for i, lst in enumerate(drawn)]


def _requests_over_topics(
    topics: Sequence[tuple[str, Sequence[str]]], num_requests: int, zipf_exponent: float, rate: float,
    burstiness: float, seed: int, popularity_seed: int, num_topics: int | None,
) -> list[Request]:
    if num_topics is not None:
        raise ValueError("give either num_topics (drawn lists) or topics (given lists), not both")
    if not topics or any(not ids for _, ids in topics):
        raise ValueError("topics must be a non-empty list of (question, non-empty doc ids)")
    order = _topic_order(len(topics), popularity_seed)  # order[0]: the most popular topic
    p = zipf_weights(len(topics), zipf_exponent)
    rng = np.random.default_rng([seed, 1])
    arrivals = arrival_times(num_requests, rate, burstiness=burstiness, rng=np.random.default_rng([seed, 2]))
    out: list[Request] = []
    for n in range(num_requests):
        t = int(order[int(rng.choice(len(topics), p=p))])
        question, ids = topics[t]
        out.append(Request(n, arrivals[n], tuple(ids), f"Request {n}: {question}", t))
    return out


def with_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """The same trace at another rate: arrival times of a trace made at rate 1.0 divided by ``rate``.

    Gamma inter-arrival gaps scale exactly, so this equals a trace generated at ``rate`` with the same seed;
    ``rate=inf`` puts every arrival at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (math.inf = all at once), got {rate}")
    return [replace(r, arrival_s=0.0 if math.isinf(rate) else r.arrival_s / rate) for r in requests]


def requests_from_retrieval(
    retrieved: Sequence[tuple[str, Sequence[str]]],
    *,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[Request]:
    """Requests from given retrieval results ``[(question, [doc_id, ...]), ...]`` (kept in order), timed by
    :func:`arrival_times` with ``seed``."""
    arrivals = arrival_times(len(retrieved), rate, burstiness=burstiness, rng=seed)
    out: list[Request] = []
    for n, (question, ids) in enumerate(retrieved):
        if not ids:
            raise ValueError(f"retrieval result {n} has no documents")
        out.append(Request(n, arrivals[n], tuple(ids), question))
    return out


@dataclass(frozen=True)
class WorkingSet:
    """Sizes of what a trace touches. Tokens exclude the per-request question.

    ``unique_docs``: distinct documents; ``doc_tokens``: their tokens counted once each;
    ``prefix_tokens``: tokens of distinct document prefixes (what a prefix-tree cache stores), including the
    shared ``system_tokens`` once; ``requested_tokens``: document tokens summed over all requests (no reuse);
    ``suffix_tokens``: the per-request tails (question, template) summed, each stored once and never reused;
    ``bytes`` = ``(prefix_tokens + suffix_tokens) * bytes_per_token``: everything the cache would store.
    """

    unique_docs: int
    doc_tokens: int
    prefix_tokens: int
    requested_tokens: int
    system_tokens: int
    suffix_tokens: int
    bytes_per_token: int
    bytes: int

    @property
    def reuse_upper_bound(self) -> float:
        """Fraction of requested document tokens an unbounded cache could reuse (first touches miss)."""
        if self.requested_tokens == 0:
            return 0.0
        return 1.0 - (self.prefix_tokens - self.system_tokens) / self.requested_tokens


def working_set(
    requests: Sequence[Request],
    doc_tokens: Mapping[str, int],
    *,
    bytes_per_token: int = 1,
    system_tokens: int = 0,
    suffix_tokens: int = 0,
) -> WorkingSet:
    """The working set of ``requests`` given each document's token count (see :class:`WorkingSet`)."""
    unique: set[str] = set()
    prefixes: set[tuple[str, ...]] = set()
    prefix_doc_tokens = 0
    requested = 0
    for req in requests:
        for j, d in enumerate(req.doc_ids):
            if d not in doc_tokens:
                raise KeyError(f"no token count for document {d!r}")
            unique.add(d)
            requested += doc_tokens[d]
            prefix = req.doc_ids[: j + 1]
            if prefix not in prefixes:
                prefixes.add(prefix)
                prefix_doc_tokens += doc_tokens[d]
    prefix_tokens = prefix_doc_tokens + (system_tokens if requests else 0)
    return WorkingSet(
        unique_docs=len(unique),
        doc_tokens=sum(doc_tokens[d] for d in unique),
        prefix_tokens=prefix_tokens,
        requested_tokens=requested,
        system_tokens=system_tokens if requests else 0,
        suffix_tokens=suffix_tokens,
        bytes_per_token=bytes_per_token,
        bytes=(prefix_tokens + suffix_tokens) * bytes_per_token,
    )


def tier_capacities(
    working_set_bytes: int,
    *,
    dram_fraction: float = 0.25,
    ssd_fraction: float = 1.0,
    min_bytes: int = 0,
) -> tuple[int, int]:
    """``(dram_bytes, ssd_bytes)`` as fractions of the working set (default: DRAM ~25%, SSD all of it).

    Each is at least ``min_bytes`` when its fraction is > 0 (so a tier can hold one chunk); a fraction of 0 gives 0.
    """
    for name, f in (("dram_fraction", dram_fraction), ("ssd_fraction", ssd_fraction)):
        if f < 0:
            raise ValueError(f"{name} must be >= 0, got {f}")
    if working_set_bytes < 0:
        raise ValueError(f"working_set_bytes must be >= 0, got {working_set_bytes}")

    def size(f: float) -> int:
        return 0 if f == 0 else max(int(working_set_bytes * f), min_bytes)

    return size(dram_fraction), size(ssd_fraction)
