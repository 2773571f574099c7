"""The four reuse bounds of a replayed trace, computed by hand on hand-built traces: which segments each bound
reuses in each request is written out here; the token count of each segment comes from the engine's own layout
(`PromptBuilder.build_rag`). One chunk per segment (a chunk size above every segment's length) so reuse is whole
segments; a smaller chunk size gives the same chain (chunks never cross a segment), checked too."""

from __future__ import annotations

import json

import pytest

from pcr_rag.bench.config import SYSTEM_PROMPT
from pcr_rag.bench.trace_bounds import (
    HEAD,
    LayoutPlanner,
    RawForwardFit,
    bounds_markdown,
    bounds_section,
    compute_bounds,
    request_layout,
)
from pcr_rag.bench.trace_file import SyntheticText, parse_trace
from pcr_rag.prompt import PromptBuilder
from pcr_rag.testing import tiny_tokenizer


def _seg(kind, sid, tokens, volatile=False):
    return {"kind": kind, "id": sid, "tokens": tokens, **({"volatile": True} if volatile else {})}


def _rag(*requests):
    return parse_trace([json.dumps({"timestamp": 10 * i, "segments": segs}) for i, segs in enumerate(requests)])


def _bounds(trace, chunk_size=4096):
    tok = tiny_tokenizer()
    text = SyntheticText(tok)
    planner = LayoutPlanner(PromptBuilder(tok), SYSTEM_PROMPT, chunk_size)
    pairs = [(request_layout(r, text.text, moved=False), request_layout(r, text.text, moved=True))
             for r in trace.requests]
    bounds = compute_bounds([], pairs, planner, cache_aware=trace.position_independent)
    # segment lengths in the engine's layout, by segment identity (the head and each trace segment)
    length: dict = {}
    for laid in bounds.served:
        for seg, ident in zip(laid.segments, laid.identities, strict=True):
            assert length.setdefault(ident, len(seg)) == len(seg)
    return bounds, length, planner


S, A, B, C = _seg("system", "S", 20), _seg("passage", "A", 30), _seg("passage", "B", 30), _seg("passage", "C", 30)


def V(i):
    return _seg("system", f"V{i}", 8, volatile=True)


def Q(i):
    return _seg("question", f"q{i}", 5)


RAG_TRACE = (
    [S, V(0), A, B, Q(0)],
    [S, V(1), B, A, Q(1)],
    [S, V(2), A, B, C, Q(2)],
    [S, V(3), C, A, _seg("history", "h", 10), Q(0)],  # the first question, asked again
)


def test_rag_bounds_by_hand():
    bounds, n, planner = _bounds(_rag(*RAG_TRACE))

    def tok(*names):
        ident = {"head": HEAD, "S": ("system", "S", 20), "A": ("passage", "A", 30), "B": ("passage", "B", 30),
                 "C": ("passage", "C", 30), "q0": ("question", "q0", 5)}
        return sum(n[ident[x]] for x in names)

    prompt = [laid.num_tokens for laid in bounds.served]
    assert bounds.prefix.prompt == tuple(prompt) and bounds.prefix_moved.prompt == tuple(prompt)
    # as served [head, S, V, passages, history, question]: every request's own V ends the match after S
    assert bounds.prefix.reused == (0, tok("head", "S"), tok("head", "S"), tok("head", "S"))
    # V after the passages: request 2 repeats request 0's [A, B]; request 1 ([B, A]) and 3 ([C, A]) do not
    assert bounds.prefix_moved.reused == (0, tok("head", "S"), tok("head", "S", "A", "B"), tok("head", "S"))
    # cache-aware: request 1 served as [A, B]; request 2 [A, B, C]; request 3 as [A, C] (A follows S before)
    assert bounds.cache_aware.reused == (0, tok("head", "S", "A", "B"), tok("head", "S", "A", "B"),
                                         tok("head", "S", "A"))
    # position-independent: every segment seen before anywhere; request 3 also its repeated question
    assert bounds.position_independent.reused == (0, tok("head", "S", "A", "B"), tok("head", "S", "A", "B"),
                                                  tok("head", "S", "C", "A", "q0"))
    total = sum(prompt)
    assert bounds.prefix.fraction == pytest.approx(3 * tok("head", "S") / total)
    fractions = [c.fraction for c in bounds.by_name().values()]
    assert fractions == sorted(fractions) and len(set(fractions)) == 4  # each bound above the one before
    # the passage tokens alone (moved layout): relevance order reuses request 2's [A, B]; cache-aware also
    # request 1's [A, B] and request 3's A
    p = bounds.passages
    passage_total = 4 * tok("A") + 3 * tok("B") + 2 * tok("C")
    assert p.doc_tokens == passage_total and p.requests == 4 and p.reordered == 2
    assert p.relevance == pytest.approx(tok("A", "B") / passage_total)
    assert p.cache_aware == pytest.approx((2 * tok("A", "B") + tok("A")) / passage_total)
    assert bounds.moved_differs and bounds.unclean == 0 and planner.checked >= 1 and planner.assembling
    # an unbounded prefix cache holds every distinct chunk of what was served
    assert bounds.stored_tokens == sum(prompt) - sum(bounds.prefix.reused)


def test_smaller_chunks_give_the_same_bounds():
    whole, _, _ = _bounds(_rag(*RAG_TRACE))
    small, _, planner = _bounds(_rag(*RAG_TRACE), chunk_size=7)
    assert max(len(laid.plan) for laid in small.served) > max(len(laid.plan) for laid in whole.served)
    for name, counts in whole.by_name().items():
        assert small.by_name()[name] == counts, name
    assert planner.assembling  # every reordering assembled from token runs matched the engine's own layout


def test_a_trace_without_volatile_parts_moves_nothing():
    bounds, _, _ = _bounds(_rag([S, A, B, Q(0)], [S, B, A, Q(1)]))
    assert bounds.prefix == bounds.prefix_moved and not bounds.moved_differs


def test_mooncake_bounds_follow_shared_hash_ids():
    lines = [json.dumps({"timestamp": 0, "input_length": 2 * 512 + 100, "output_length": 4, "hash_ids": [1, 2, 3]}),
             json.dumps({"timestamp": 5, "input_length": 2 * 512 + 50, "output_length": 4, "hash_ids": [1, 2, 4]}),
             json.dumps({"timestamp": 9, "input_length": 600, "output_length": 4, "hash_ids": [1, 5]})]
    trace = parse_trace(lines).scaled(1 / 32)  # 16-token blocks
    bounds, n, _ = _bounds(trace)
    b1, b2 = n[("block", "1", 16)], n[("block", "2", 16)]
    assert bounds.prefix.reused == (0, n[HEAD] + b1 + b2, n[HEAD] + b1)  # the shared leading hash ids
    # ids chain by prefix: a seen block always follows what it followed before, so nothing beyond the prefix
    assert bounds.position_independent == bounds.prefix == bounds.prefix_moved
    assert bounds.cache_aware is None and bounds.passages is None


def test_raw_forward_fit_recovers_its_terms():
    true = RawForwardFit(0.01, 2e-4, 3e-8)
    points = [(p, k, true.seconds(k, p)) for p, k in ((1, 64), (1, 1000), (900, 64), (500, 500))]
    fit = RawForwardFit.fit(points)
    assert fit.fixed_s == pytest.approx(0.01) and fit.per_token_s == pytest.approx(2e-4)
    assert fit.per_token_context_s == pytest.approx(3e-8)
    # noise that makes the context term negative: it is dropped, the rest refitted, nothing below zero
    noisy = RawForwardFit.fit([(1, 10, 0.02), (1, 100, 0.11), (100, 10, 0.019), (50, 50, 0.06)])
    assert noisy.per_token_context_s == 0 and noisy.fixed_s >= 0 and noisy.per_token_s > 0
    with pytest.raises(ValueError, match="at least 3 points"):
        RawForwardFit.fit(points[:2])


def test_bounds_section_and_markdown():
    bounds, _, _ = _bounds(_rag(*RAG_TRACE))
    prompt = list(bounds.prefix.prompt)
    fit = RawForwardFit(0.001, 1e-4, 0.0)
    reused = list(bounds.prefix.reused)
    run = {"system": "pcr", "reuse_ratio": sum(reused) / sum(prompt), "ttft": {"mean": 0.05},
           "requests": {"prompt_tokens": prompt, "reused_dram": reused, "reused_ssd": [0] * 4,
                        "reused_device": [0] * 4, "reused_remote": [0] * 4}}
    section = bounds_section(bounds, [run], fit=fit, info={"requests": 4}, notes=["a note"])
    rows = section["bounds"]
    assert list(rows) == ["no_reuse", "prefix", "prefix_moved", "cache_aware", "position_independent"]
    assert rows["no_reuse"]["fraction"] == 0 and rows["prefix"]["fraction"] == bounds.prefix.fraction
    # TTFT bound: the mean raw forward of each request's computed tokens (fit is linear here)
    computed = [p - r for p, r in zip(prompt, reused, strict=True)]
    assert rows["prefix"]["ttft_bound_s"] == pytest.approx(0.001 + 1e-4 * sum(computed) / 4)
    ttfts = [rows[k]["ttft_bound_s"] for k in rows]
    assert ttfts == sorted(ttfts, reverse=True)  # more reuse, a lower bound
    (reached,) = section["reached"]
    assert reached["reuse_over_prefix_bound"] == pytest.approx(1.0) and reached["prompt_tokens_as_laid_out"]
    assert reached["raw_forward_of_computed_s"] == pytest.approx(rows["prefix"]["ttft_bound_s"])
    text = "\n".join(bounds_markdown(section))
    assert "## Trace replay: reuse bounds" in text and "| pcr |" in text and "- a note" in text
    assert "position-independent" in text and "Passage tokens alone" in text
