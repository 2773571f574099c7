"""`pcr_rag.bench.blend_ledger`: a blend request's placed tokens split into KV an earlier request left (reuse) and
KV computed in isolation for the request itself (a document's first use), a plan it cannot replay flagged, and the
report's blend figures (reuse split, raw forward of the computed tokens, the blend section's targets) built from
per-request columns."""

from __future__ import annotations

import math

import pytest

from pcr_rag.bench.blend_ledger import BlendLedger, context_sum
from pcr_rag.bench.trace_bounds import RawForwardFit, blend_section, raw_forward_seconds, reuse_split
from pcr_rag.prompt import PromptBuilder
from pcr_rag.sched.blend import BlendDocument, blend_spans
from pcr_rag.testing import tiny_tokenizer

A, B, C, D, E = ("alpha beta gamma delta epsilon", "one two three four five six seven", "red green blue cyan",
                 "north south east west up down", "spring summer autumn winter")
SYSTEM = "You answer."


@pytest.fixture(scope="module")
def builder():
    return PromptBuilder(tiny_tokenizer())


def _placed(builder, docs, exact, recompute, placeable):
    """The prompt, its segment offsets and the placed tokens per document when the documents ``placeable`` are
    placed after an exact prefix of ``exact`` tokens, by blend mode's own planner (`blend_spans`)."""
    seg = builder.build_rag("q?", docs, SYSTEM)
    offsets = [0]
    for s in seg.segments:
        offsets.append(offsets[-1] + len(s))
    documents = [BlendDocument(offsets[i], offsets[i + 1], b"") for i in seg.document_segments]
    per_doc = [0] * len(documents)
    for s in blend_spans(seg.num_tokens, exact, documents, placeable, recompute):
        if s.placed:
            per_doc[s.document] += s.end - s.start
    return seg, offsets, per_doc


@pytest.mark.parametrize("recompute", [0.0, 0.5])
def test_first_use_is_fresh_and_later_uses_are_reuse(builder, recompute):
    ledger = BlendLedger(builder, recompute, SYSTEM)
    head = builder.build_rag("q?", [A], SYSTEM).segments[0]
    head = len(head)
    # request 1, only the head exact: A, new and right after the exact match, is computed in context (the engine
    # extends the exact tree with it); B and C, new, are placed after an isolated prefill: fresh, not reuse
    seg, offsets, placed = _placed(builder, [A, B, C], head, recompute, [1, 2])
    first = ledger.serve("q?", [A, B, C], seg.token_ids, head, sum(placed))  # an engine counting every placed token
    assert first.consistent and placed[0] == 0 and first.fresh == first.placed == sum(placed) > 0
    assert first.blended_reused == 0
    # request 2, exact through A: C and B placed from the KV request 1 left
    seg2, _, placed2 = _placed(builder, [A, C, B], offsets[2], recompute, [1, 2])
    second = ledger.serve("q?", [A, C, B], seg2.token_ids, offsets[2], sum(placed2))
    assert second.consistent and second.fresh == 0 and second.blended_reused == sum(placed2) > 0
    # request 3: a new first document D is computed in context, B and C are reused
    seg3, _, placed3 = _placed(builder, [D, B, C], head, recompute, [1, 2])
    third = ledger.serve("q?", [D, B, C], seg3.token_ids, head, sum(placed3))
    assert third.consistent and third.fresh == 0 and third.blended_reused == sum(placed3) > 0
    # request 4: B first (it has position-independent KV: placed), E new after it (fresh), C reused; an engine
    # counting only placed tokens an earlier request left
    seg4, _, placed4 = _placed(builder, [B, E, C], head, recompute, [0, 1, 2])
    fourth = ledger.serve("q?", [B, E, C], seg4.token_ids, head, placed4[0] + placed4[2])
    assert fourth.consistent and fourth.fresh == placed4[1] > 0 and fourth.blended_reused == placed4[0] + placed4[2]
    # computed in context: the rest of the prompt, and every computed position is either in context or fresh
    computed = sum(e - s for s, e in fourth.compute_spans)
    assert computed + fourth.placed + head == seg4.num_tokens
    assert sum(e - s for s, e in fourth.computed_spans) == computed + fourth.fresh
    assert fourth.compute_spans[-1][1] == seg4.num_tokens  # the last position is always computed
    if recompute:  # each placed document's head is recomputed first: a compute span before each
        assert len(fourth.compute_spans) >= 3
    # request 5: A was never placed (computed in context, then inside the exact prefix): it has no
    # position-independent KV, so placing it after B is fresh
    seg5, _, placed5 = _placed(builder, [B, A], head, recompute, [0, 1])
    fifth = ledger.serve("q?", [B, A], seg5.token_ids, head, placed5[0])
    assert fifth.consistent and fifth.fresh == placed5[1] > 0
    assert ledger.inconsistent == 0


def test_a_plan_the_ledger_cannot_replay_is_flagged(builder):
    ledger = BlendLedger(builder, 0.0, SYSTEM)
    seg, offsets, placed = _placed(builder, [A, B], 0, 0.0, [1])
    # neither every placed token (B's) nor those from earlier KV (none): e.g. the engine computed B in place
    off = ledger.serve("q?", [A, B], seg.token_ids, offsets[1], placed[1] - 1)
    assert not off.consistent and off.fresh is None and off.blended_reused is None
    other = ledger.serve("q?", [A, B], [*seg.token_ids, 7], offsets[1], 0)  # not the engine's layout
    assert not other.consistent and ledger.inconsistent == 2


def test_context_sum_is_the_suffix_context_term():
    assert context_sum([(10, 14)]) == pytest.approx(4 * (10 + 4 / 2))
    assert context_sum([(0, 3), (5, 6)]) == pytest.approx(0.5 + 1.5 + 2.5 + 5.5)
    fit = RawForwardFit(0.001, 0.0001, 1e-7)
    assert fit.seconds_at(4, context_sum([(10, 14)])) == pytest.approx(fit.seconds(4, 10))
    assert 0 < fit.attention_share(2000) < 1 and fit.attention_share(0) == 0
    assert fit.attention_share(4000) > fit.attention_share(2000)  # quadratic against linear


def _run(system, ttft, prompt, reused, placed=None, fresh=None, context=None, spans=None):
    n = len(ttft)
    tokens = {"prompt": sum(prompt), "reused": sum(reused)}
    blended = placed_reused = None
    if placed is not None:  # an engine counting only placed tokens an earlier request left
        blended = placed_reused = [p - f for p, f in zip(placed, fresh, strict=True)]
        tokens.update(blended=sum(blended), blended_fresh=sum(fresh), blended_reused=sum(placed_reused))
    return {"system": system, "reuse_ratio": sum(reused) / sum(prompt), "tokens": tokens,
            "ttft": {"mean": sum(ttft) / n}, "queue": {"mean": 0.0}, "extra": {"blend_recompute": 0.15},
            "requests": {"key": [[0, i] for i in range(n)], "ttft": ttft, "prefill": ttft,
                         "prefill_compute": [t * 0.8 for t in ttft], "prompt_tokens": prompt,
                         "reused_dram": reused, "blended": blended or [0] * n,
                         "blended_reused": placed_reused or [None] * n, "blended_fresh": fresh or [None] * n,
                         "compute_context": context or [None] * n, "compute_spans": spans or [None] * n}}


def test_blend_section_counts_placed_reuse_and_judges_the_targets():
    fit = RawForwardFit(0.002, 0.001, 1e-6)
    prompt = [100, 100, 100, 100]
    pcr = _run("pcr", [0.10, 0.11, 0.09, 0.10], prompt, [20, 20, 20, 20])
    # blend: exact 20 each, 60 placed of which 30 fresh on the first two requests; computed 20 in context
    context = [context_sum([(80, 100), (20, 50)]), context_sum([(80, 100), (20, 50)]), context_sum([(80, 100)]),
               context_sum([(80, 100)])]
    blend = _run("pcr-blend", [0.05, 0.05, 0.04, 0.04], prompt, [20] * 4, [60] * 4, [30, 30, 0, 0], context,
                 [2, 2, 2, 2])
    split = reuse_split(blend)
    assert split["exact"] == pytest.approx(0.2) and split["blended"] == pytest.approx(0.45)
    assert split["blended_fresh"] == pytest.approx(0.15) and split["reuse"] == pytest.approx(0.2 + 0.45)
    assert reuse_split(pcr) == {"reuse": 0.2, "exact": 0.2, "blended": 0.0, "blended_reused": 0.0,
                                "blended_fresh": 0.0}
    raws = raw_forward_seconds(blend, fit)
    assert raws[0] == pytest.approx(fit.seconds_at(50, context[0])) and raws[2] == pytest.approx(
        fit.seconds_at(20, context[2]))
    assert raw_forward_seconds(pcr, fit)[0] == pytest.approx(fit.seconds(80, 20))
    rows = {"position_independent": {"fraction": 0.7}}
    (section,) = blend_section([pcr, blend], rows, fit, prompt)
    assert section["system"] == "pcr-blend" and section["reuse_over_position_independent"] == pytest.approx(0.65 / 0.7)
    assert section["targets"]["reuse_over_position_independent"]["passed"] is True  # 0.93 >= 0.8
    limit = section["limit_ratio"]
    assert limit["ratio"] == pytest.approx(0.045 / (sum(raws) / 4)) and limit["low"] <= limit["ratio"] <= limit["high"]
    assert section["targets"]["limit_ratio"]["passed"] is (limit["high"] <= 1.2)
    assert section["limit_ratio_own_compute"]["ratio"] == pytest.approx(0.8 * limit["ratio"])
    vs = section["ttft_vs_pcr"]
    assert vs["ratio"] == pytest.approx(0.045 / 0.1) and section["targets"]["ttft_vs_pcr"]["passed"] is True
    assert section["ttft_vs_no_reuse"] is None  # no no-reuse run: not measured, not a miss
    assert 0 < section["attention_share_full_prefill"] < 1 and section["compute_spans_mean"] == 2
    assert not math.isnan(section["raw_forward_mean_s"])
