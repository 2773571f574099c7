"""A small RAG segment trace shaped like the real one issue 48 describes, so ``pcr-rag bench --trace`` runs out of
the box (``benchmarks/traces/example_rag.jsonl`` is this module's output with the defaults).

Every request carries: one static system part (``sys-base``), a volatile system part before the passages
(``context-<n>``: the date and time and the user's profile, new in every request), 3 to 5 passages of a
session's topic (drawn with Zipf popularity from a pool, so lists overlap and come back in new orders), for a
follow-up turn the session's earlier questions and answers as history, and a question (a few popular questions
repeat verbatim).
Arrivals are a Poisson process (``mean_gap_ms`` between requests). Deterministic for a seed.

Regenerate: ``python -m pcr_rag.bench.trace_example --out benchmarks/traces/example_rag.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from pcr_rag.bench.workload import zipf_weights

__all__ = ["example_rag_trace", "main"]


def example_rag_trace(num_requests: int = 40, *, seed: int = 0, passages: int = 24, system_tokens: int = 180,
                      context_tokens: int = 60, mean_gap_ms: float = 3000.0) -> list[dict[str, Any]]:
    """The example trace as JSON-ready request dicts (see the module docstring); lengths in tokens."""
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(120, 261, size=passages)]
    popular = zipf_weights(passages, 1.0)
    ranked = rng.permutation(passages)  # ranked[r]: the passage with popularity rank r
    questions = [int(x) for x in rng.integers(15, 41, size=num_requests)]
    hot_questions = 4  # popular questions asked again, word for word
    out: list[dict[str, Any]] = []
    t = 0.0
    session: dict[str, Any] | None = None
    for n in range(num_requests):
        if session is None or rng.random() < 0.6:  # a new session: no history, passages of a new topic
            session = {"turns": [], "topic": [int(ranked[i]) for i in
                                                         rng.choice(passages, size=6, replace=False, p=popular)]}
        k = int(rng.integers(3, 6))
        picks = list(rng.permutation(session["topic"])[:k])  # overlapping lists in new orders
        if rng.random() < 0.2:  # a hot question: the same id (and text) as before
            qid, qlen = f"q-hot-{int(rng.integers(hot_questions))}", 24
        else:
            qid, qlen = f"q-{n}", questions[n]
        segments: list[dict[str, Any]] = [
            {"kind": "system", "id": "sys-base", "tokens": system_tokens},
            {"kind": "system", "id": f"context-{n}", "tokens": context_tokens, "volatile": True},
            *({"kind": "passage", "id": f"p{p}", "tokens": lengths[p]} for p in picks),
            *({"kind": "history", "id": h, "tokens": tok} for h, tok in session["turns"]),
            {"kind": "question", "id": qid, "tokens": qlen},
        ]
        out.append({"timestamp": round(t), "segments": segments, "output_length": int(rng.integers(16, 65))})
        session["turns"] += [(f"{qid}-asked-{n}", qlen), (f"answer-{n}", int(rng.integers(30, 81)))]
        t += float(rng.exponential(mean_gap_ms))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON Lines file to write")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mean-gap-ms", type=float, default=3000.0)
    args = parser.parse_args(argv)
    trace = example_rag_trace(args.requests, seed=args.seed, mean_gap_ms=args.mean_gap_ms)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in trace), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
