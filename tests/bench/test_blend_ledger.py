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
from pcr_rag.runtime.blend import BlendDocument, blend_spans
from pcr_rag.testing import tiny_tokenizer

A, B, C, D = ("alpha beta gamma delta epsilon", "one two three four five six seven", "red green blue cyan",
              "north south east west up down")
SYSTEM = "You answer."


@pytest.fixture(scope="module")
def builder():
    return PromptBuilder(tiny_tokenizer())


def _placed(builder, docs, exact, recompute):
    """Placed tokens per document (prompt order) by blend mode's own planner: what the engine reports in all."""
    seg = builder.build_rag("q?", docs, SYSTEM)
    offsets = [0]
    for s in seg.segments:
        offsets.append(offsets[-1] + len(s))
    documents = [BlendDocument(offsets[i], offsets[i + 1], b"") for i in seg.document_segments]
    spans = blend_spans(seg.num_tokens, exact, documents, [i for i, d in enumerate(documents) if d.end > exact],
                        recompute)
    per_doc = [0] * len(documents)
    for s in spans:
        if s.placed:
            per_doc[s.document] += s.end - s.start
    return seg, offsets, per_doc


@pytest.mark.parametrize("recompute", [0.0, 0.5])
def test_first_use_is_fresh_and_later_uses_are_reuse(builder, recompute):
    ledger = BlendLedger(builder, recompute, SYSTEM)
    # request 1: only the head is exact; every document is new, so everything placed was computed for it
    _, offsets, _ = _placed(builder, [A, B, C], 0, recompute)
    head = offsets[1]
    seg, offsets, placed = _placed(builder, [A, B, C], head, recompute)
    first = ledger.serve("q?", [A, B, C], seg.token_ids, head, sum(placed))  # an engine counting every placed token
    assert first.consistent and first.fresh == first.placed == sum(placed) > 0 and first.blended_reused == 0
    # request 2: same first document (exact through it), the other two swapped: both placed from earlier KV
    seg2, _, placed2 = _placed(builder, [A, C, B], offsets[2], recompute)
    second = ledger.serve("q?", [A, C, B], seg2.token_ids, offsets[2], sum(placed2))
    assert second.consistent and second.fresh == 0 and second.blended_reused == sum(placed2) > 0
    # request 3: a new first document (nothing exact but the head): D is fresh, B and C are reused
    seg3, _, placed3 = _placed(builder, [D, B, C], head, recompute)
    # an engine counting only placed tokens an earlier request left
    third = ledger.serve("q?", [D, B, C], seg3.token_ids, head, placed3[1] + placed3[2])
    assert third.consistent and third.fresh == placed3[0] > 0 and third.blended_reused == placed3[1] + placed3[2] > 0
    # computed in context: the rest of the prompt, and every computed position is either in context or fresh
    computed = sum(e - s for s, e in third.compute_spans)
    assert computed + third.placed + head == seg3.num_tokens
    assert sum(e - s for s, e in third.computed_spans) == computed + third.fresh
    assert third.compute_spans[-1][1] == seg3.num_tokens  # the last position is always computed
    if recompute:  # each placed document's head is recomputed first: one more compute span per document
        assert len(third.compute_spans) >= 3
    assert ledger.inconsistent == 0


def test_a_document_served_inside_the_exact_prefix_left_no_position_independent_kv(builder):
    # blend mode keeps a document's position-independent KV only once it placed it (after the exact prefix)
    ledger = BlendLedger(builder, 0.0, SYSTEM)
    _, offsets, _ = _placed(builder, [A, B], 0, 0.0)
    seg, _, placed = _placed(builder, [A, B], offsets[2], 0.0)  # A inside the exact prefix, B placed
    first = ledger.serve("q?", [A, B], seg.token_ids, offsets[2], sum(placed))
    assert first.consistent and placed[0] == 0 and first.fresh == placed[1] > 0
    seg2, off2, placed2 = _placed(builder, [C, A], offsets[1], 0.0)
    second = ledger.serve("q?", [C, A], seg2.token_ids, offsets[1], sum(placed2))
    assert second.consistent and second.fresh == sum(placed2) == placed2[0] + placed2[1] and placed2[1] > 0


def test_a_plan_the_ledger_cannot_replay_is_flagged(builder):
    ledger = BlendLedger(builder, 0.0, SYSTEM)
    seg, offsets, placed = _placed(builder, [A, B], 0, 0.0)
    off = ledger.serve("q?", [A, B], seg.token_ids, offsets[1], sum(placed) - 1)  # e.g. one document computed
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
            "requests": {"key": [[0, i] for i in range(n)], "ttft": ttft, "prefill": ttft, "prompt_tokens": prompt,
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
    vs = section["ttft_vs_pcr"]
    assert vs["ratio"] == pytest.approx(0.045 / 0.1) and section["targets"]["ttft_vs_pcr"]["passed"] is True
    assert section["ttft_vs_no_reuse"] is None  # no no-reuse run: not measured, not a miss
    assert 0 < section["attention_share_full_prefill"] < 1 and section["compute_spans_mean"] == 2
    assert not math.isnan(section["raw_forward_mean_s"])
