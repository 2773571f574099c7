"""Blend mode in the simulator (`pcr_rag.sched.blend` as `Simulator` models it) and the trace-file replay of
``pcr-rag simulate --trace``: documents in new orders reuse more and cost less, only KV cached before a request
counts as blended, the compute spans run as the runtime's steps (several spans per forward), the first new document
after the exact match is computed exactly and later requests reuse it exactly, recompute 1.0 is exact PCR, blended
requests never inflate later exact reuse, the anchor is computed once per cache."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from pcr_rag.bench.trace_file import parse_trace, read_trace
from pcr_rag.cache.keys import blend_root, namespace_key, plan_chunks
from pcr_rag.model.forward import ATTENTION_BLOCK
from pcr_rag.sched.blend import BlendDocument, Span, blend_spans
from pcr_rag.sched.runner import PrefillTask, _aligned_end
from pcr_rag.sim.costmodel import CostModel, PrefillWork, attention_pairs
from pcr_rag.sim.profiles import get_profile
from pcr_rag.sim.simulator import SimConfig, Simulator, engine_steps
from pcr_rag.sim.systems import engine_default, get_system
from pcr_rag.sim.trace import TraceBuilder, segment_doc_id, segment_tokens, synthetic_tokens, trace_requests
from pcr_rag.sim.trace_replay import (
    ReplayOptions,
    blend_variants,
    build_trace_scenario,
    replay_bounds,
    replay_trace,
)

CS = 16  # tokens per chunk
DOC = 24 * CS  # tokens per document: long enough that linear layers, not per-step overheads, dominate
EXAMPLE = "benchmarks/traces/example_rag.jsonl"


def _profile():
    return get_profile("rtx4090-llama2-7b")


def _builder(doc_tokens: int = DOC) -> TraceBuilder:
    return TraceBuilder(namespace_key("t", "fp16", CS), CS, lambda d: synthetic_tokens(d, doc_tokens),
                        system_tokens=synthetic_tokens("sys", CS), question_tokens=4)


def _reqs(docs_per_req, gap: float = 10.0, **kw):
    tb = _builder(**kw)
    return [tb.request(i, i * gap, docs, 2) for i, docs in enumerate(docs_per_req)]


def _system(name: str, **changes):
    return dataclasses.replace(get_system(name), **changes)


def _sim(system, *, dram_chunks: int = 10_000, ssd_chunks: int = 10_000, **kw) -> Simulator:
    prof = kw.pop("profile", None) or _profile()
    cb = CS * prof.kv_bytes_per_token
    return Simulator(SimConfig(prof, system, chunk_size=CS, dram_bytes=dram_chunks * cb, ssd_bytes=ssd_chunks * cb,
                               **kw))


REORDERED = [("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a"), ("c", "b", "a"), ("a", "c", "b"), ("b", "a", "c")]


def test_pcr_blend_is_the_bench_system_in_blend_mode():
    s = get_system("pcr-blend")
    assert s.blend and not get_system("pcr").blend and not get_system("no-reuse").blend
    from pcr_rag.config import EngineConfig

    assert s.blend_recompute == EngineConfig().blend_recompute
    assert dataclasses.replace(s, blend=False, name="pcr", description=get_system("pcr").description) \
        == get_system("pcr")
    with pytest.raises(ValueError, match="fraction"):
        dataclasses.replace(s, blend_recompute=1.5)


def test_documents_in_new_orders_reuse_more_and_cost_less_with_blend():
    reqs = _reqs(REORDERED)
    out = {name: _sim(get_system(name)).run(reqs).outcomes for name in ("pcr", "pcr-blend")}
    pcr, blend = out["pcr"], out["pcr-blend"]
    prompt = sum(o.prompt_tokens for o in pcr)
    assert prompt == sum(o.prompt_tokens for o in blend)
    reused_pcr = sum(o.exact_tokens + o.blended_tokens for o in pcr)
    reused_blend = sum(o.exact_tokens + o.blended_tokens for o in blend)
    assert sum(o.blended_tokens + o.placed_tokens for o in pcr) == 0
    assert reused_blend > 2 * reused_pcr
    # the first request computes "a" in context (right after the exact match) and "b", "c" in isolation; the
    # second computes "a" in isolation (placed after "c"); from then on every document is placed from the cache
    anchor = _builder().anchor_tokens
    assert [o.isolated_tokens for o in blend[:2]] == [anchor + 2 * DOC, DOC]
    assert all(o.isolated_tokens == 0 and o.blended_tokens == o.placed_tokens > 0 for o in blend[2:])
    later = slice(2, None)
    assert sum(o.ttft_s for o in blend[later]) < 0.4 * sum(o.ttft_s for o in pcr[later])
    assert sum(o.ttft_s for o in blend) < sum(o.ttft_s for o in pcr)
    for o in blend:  # the runtime's accounting: computed + exact + blended == prompt
        assert o.computed_tokens + o.exact_tokens + o.blended_tokens == o.prompt_tokens
        assert o.blended_tokens <= o.placed_tokens


def test_the_spans_are_the_runtimes_and_a_first_seen_document_counts_as_computed():
    """A request's placed tokens and exact boundary are `blend_spans`' for its documents after the exact match:
    each placed document keeps its first ceil(r * n) tokens computed, the question is computed. Of them only the
    documents whose position-independent KV was cached before the request count as blended (the issue's
    definition of reused): "a", computed in isolation by this very request, counts as computed."""
    reqs = _reqs(REORDERED[:2])
    sim = _sim(get_system("pcr-blend"))
    res = sim.run(reqs)
    first, second, req = res.outcomes[0], res.outcomes[1], reqs[1]
    assert first.blended_tokens == 0 and first.placed_tokens > 0  # nothing was cached before it
    exact = second.exact_tokens
    assert exact == CS  # the system chunk; "c" follows, which the first request never computed in context
    docs = [BlendDocument(d.start, d.end, b"") for d in req.documents]
    spans = blend_spans(req.prompt_tokens, exact, docs, range(len(docs)), get_system("pcr-blend").blend_recompute)
    assert second.placed_tokens == sum(s.end - s.start for s in spans if s.placed)
    head = math.ceil(get_system("pcr-blend").blend_recompute * DOC)
    assert second.placed_tokens == 3 * (DOC - head)
    assert [d.doc_id for d in req.documents] == ["c", "a", "b"]
    assert second.blended_tokens == 2 * (DOC - head)  # "c" and "b", cached by the first request's isolated prefills
    assert second.isolated_tokens == DOC  # "a", behind the cached anchor
    assert second.computed_tokens == req.prompt_tokens - CS - 2 * (DOC - head)
    sim.close()


def test_recompute_one_is_exact_pcr():
    reqs = _reqs(REORDERED)
    pcr = _sim(get_system("pcr")).run(reqs).outcomes
    full = _sim(_system("pcr-blend", blend_recompute=1.0)).run(reqs).outcomes
    assert [o.computed_tokens for o in full] == [o.computed_tokens for o in pcr]
    assert [o.reused for o in full] == [o.reused for o in pcr]
    assert all(o.blended_tokens == 0 and o.placed_tokens == 0 and o.isolated_tokens == 0 for o in full)
    assert [o.ttft_s for o in full] == pytest.approx([o.ttft_s for o in pcr])


def test_blended_requests_do_not_inflate_later_exact_reuse():
    """Nothing computed after a placed document enters the exact index: a later request with the same documents
    in the same order reuses exactly only what the first one computed before its first placed position ("a",
    computed in context as the first new document, and "b"'s recomputed head)."""
    reqs = _reqs([("a", "b"), ("a", "b")])
    sim = _sim(get_system("pcr-blend"))
    first, second = sim.run(reqs).outcomes
    frac = get_system("pcr-blend").blend_recompute
    exact_until = CS + DOC + math.ceil(frac * DOC)  # the system chunk, "a", then "b"'s recomputed head
    assert first.placed_tokens > 0 and first.blended_tokens == 0
    plan = reqs[0].plan
    for c in plan:
        cached = bool(sim.engine.tiers_of(c.key))
        assert cached == (c.end <= exact_until), (c.start, c.end)
    assert second.exact_tokens == exact_until // CS * CS
    assert second.blended_tokens == second.placed_tokens > 0  # the rest of "b", from its cached isolated KV
    pcr_second = _sim(get_system("pcr")).run(reqs).outcomes[1]
    assert pcr_second.exact_tokens > second.exact_tokens  # exact PCR reuses the whole [system][a][b] chain
    sim.close()


def test_the_first_new_document_after_the_exact_match_is_exact_and_reused_exactly_later():
    """The document right after the exact match whose position-independent chain is not cached is computed in
    context, exactly, instead of in isolation (`PrefillTask._begin_blend`): its chunks extend the exact index, so
    a later request with the same head reuses it exactly; a cached chain is placed as usual."""
    reqs = _reqs([("a", "b"), ("a", "c"), ("a", "c"), ("c", "a")])
    sim = _sim(get_system("pcr-blend"))
    first, second, third, fourth = sim.run(reqs).outcomes
    anchor = _builder().anchor_tokens
    assert first.isolated_tokens == anchor + DOC  # "b" only: "a" is computed in context
    assert sim.engine.tiers_of(reqs[0].plan[(CS + DOC) // CS - 1].key)  # "a"'s last chunk is in the exact index
    # "c" right after the exact [system][a]: new, so computed in context, not placed and not isolated
    assert second.exact_tokens == CS + DOC
    assert (second.placed_tokens, second.blended_tokens, second.isolated_tokens) == (0, 0, 0)
    assert second.computed_tokens == second.prompt_tokens - CS - DOC
    assert not any(sim.engine.tiers_of(k) for k in reqs[1].documents[1].keys[1:])  # no isolated chain of "c"
    # ... and the next request with the same head reuses it exactly, up to the question's chunk
    assert third.exact_tokens == CS + 2 * DOC and third.placed_tokens == 0
    # "c" first, then "a": "c" is new right after the system chunk (computed in context), "a" has no isolated
    # chain either (it was always computed in context): it is computed in isolation and placed
    assert fourth.exact_tokens == CS and fourth.isolated_tokens == DOC and fourth.blended_tokens == 0
    assert fourth.placed_tokens == DOC - math.ceil(get_system("pcr-blend").blend_recompute * DOC)
    sim.close()


def test_the_anchor_is_computed_once_per_cache_and_a_new_document_once():
    reqs = _reqs([("a", "b"), ("c", "d"), ("b", "d", "c"), ("c", "a")])
    sim = _sim(get_system("pcr-blend"))
    outs = sim.run(reqs).outcomes
    anchor = _builder().anchor_tokens
    # "a" and "c" come first (computed in context), "b" and "d" are computed in isolation, the anchor once;
    # then "c" is placed after "b" and "d" (cached) and computed in isolation once; last, "c" is exact and "a"
    # follows it new: computed in context
    assert [o.isolated_tokens for o in outs] == [anchor + DOC, DOC, DOC, 0]
    assert outs[2].blended_tokens == 2 * (DOC - math.ceil(get_system("pcr-blend").blend_recompute * DOC))
    assert outs[3].exact_tokens == CS + DOC and outs[3].placed_tokens == 0
    sim.close()


def test_isolated_chains_on_ssd_are_read_and_promoted():
    """A document whose chain left DRAM is prefilled in isolation from the SSD (its last token computed) and kept
    in DRAM again, as the runtime's isolated task does; its placed tokens count as blended up to the position its
    cached prefix ends at (the runtime's ``reused_by_tier`` of the isolated task: all but that last token)."""
    reqs = _reqs([("s", "a"), ("x", "y", "z"), ("s", "a")], doc_tokens=4 * CS)
    sim = _sim(get_system("pcr-blend"), dram_chunks=6)
    res = sim.run(reqs)
    assert res.counters["ssd_read_bytes"] > 0
    last = res.outcomes[2]
    assert last.isolated_tokens == 1
    assert last.blended_tokens == last.placed_tokens - 1 > 0
    assert all(sim.engine.tiers_of(c.key) for c in reqs[2].documents[1].plan)
    sim.close()


def _runtime_steps(spans: list[tuple[int, int]], budget: int) -> list[tuple[tuple[int, int], ...]]:
    """The steps the runtime runs over ``spans``: `PrefillTask._blend_step` itself (on a stand-in of the task's
    position state) and `_aligned_end`, with `PrefillTask._step`'s position bookkeeping after each step."""
    task = SimpleNamespace(position=spans[0][0], _span_end=spans[0][1],
                           _compute_spans=[Span(lo, hi) for lo, hi in spans[1:]])
    steps: list[tuple[tuple[int, int], ...]] = []
    while True:
        positions, rest = PrefillTask._blend_step(task, budget)
        if positions is None:
            end = min(task._span_end, _aligned_end(task.position, budget, ATTENTION_BLOCK))
            steps.append(((task.position, end),))
            task.position = end
            if task.position < task._span_end:
                continue
            if not task._compute_spans:
                return steps
            span = task._compute_spans.pop(0)
            task.position, task._span_end = span.start, span.end
            continue
        pos = positions.tolist()
        cuts = [0, *(i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1), len(pos)]
        steps.append(tuple((pos[a], pos[b - 1] + 1) for a, b in zip(cuts, cuts[1:])))
        if not rest:
            return steps
        task.position, task._span_end, task._compute_spans = rest[0].start, rest[0].end, list(rest[1:])


@pytest.mark.parametrize("spans", [
    [(0, 1000)],
    [(16, 74), (400, 458), (784, 842), (1168, 1172)],
    [(100, 700), (900, 950), (1000, 1010), (1200, 1500), (1600, 1601)],
    [(0, 130), (200, 330), (500, 501)],
])
@pytest.mark.parametrize("budget", [1, 64, 256, 10_000])
def test_engine_steps_are_the_runtimes(spans, budget):
    steps = engine_steps(spans, budget, ATTENTION_BLOCK)
    assert steps == _runtime_steps(spans, budget)
    assert [p for step in steps for p in step if p[1] > p[0]] == sorted(p for step in steps for p in step)
    assert sum(hi - lo for step in steps for lo, hi in step) == sum(hi - lo for lo, hi in spans)
    assert all(sum(hi - lo for lo, hi in step) <= budget for step in steps)


def test_one_forward_per_budget_across_the_compute_spans():
    """In the runtime's steps a blend request's compute spans share forwards, ``prefill_chunk_tokens`` tokens
    each, so a request that places every document pays ceil(computed in context / budget) forwards - about as
    many as an exact one, not one per document - plus one per document computed in isolation."""
    reqs = _reqs(REORDERED)
    budget = int(engine_default("prefill_chunk_tokens"))
    for frac in (0.15, 0.5):
        sim = _sim(_system("pcr-blend", blend_recompute=frac), prefill_steps="engine")
        outs = sim.run(reqs).outcomes
        sim.close()
        for o in outs:
            in_context = o.prompt_tokens - o.exact_tokens - o.placed_tokens
            assert o.forward_steps == math.ceil(in_context / budget) + o.isolated_tokens // DOC, (frac, o)
        assert all(o.isolated_tokens == 0 for o in outs[2:])
        assert max(o.forward_steps for o in outs[2:]) <= 3
    pcr = _sim(get_system("pcr"), prefill_steps="engine").run(reqs).outcomes
    assert all(o.forward_steps >= 4 for o in pcr)


def test_a_scattered_step_pays_one_fixed_cost_and_each_spans_own_context():
    """One forward over two spans costs what the two spans cost as separate steps (each at its own context: the
    attention pairs of `attention_pairs`) less one step's fixed cost."""
    cm = CostModel(_profile())
    p = cm.profile
    spans = [(100, 150), (900, 930)]
    apart = PrefillWork(cached_tokens=100, compute_steps=(50, 30), step_context=(100, 900), offload=False)
    together = PrefillWork(cached_tokens=100, compute_steps=(80,), offload=False,
                           step_pairs=(sum(attention_pairs(lo, hi) for lo, hi in spans),))
    fixed = p.num_layers * p.layer_s_fixed + p.step_s_fixed
    assert cm.prefill(together, overlap=True).total_s == pytest.approx(
        cm.prefill(apart, overlap=True).total_s - fixed)
    assert attention_pairs(100, 150) == 50 * 100 + 50 * 51 / 2
    contiguous = PrefillWork(cached_tokens=100, compute_steps=(80,), offload=False)  # [100, 180): less context
    assert cm.prefill(together, overlap=True).total_s > cm.prefill(contiguous, overlap=True).total_s


def test_cost_model_steps_at_their_own_context():
    cm = CostModel(_profile())
    implicit = PrefillWork(cached_tokens=100, compute_steps=(50, 30), offload=False)
    explicit = dataclasses.replace(implicit, step_context=(100, 150))
    assert cm.prefill(implicit, overlap=True).total_s == pytest.approx(cm.prefill(explicit, overlap=True).total_s)
    later = dataclasses.replace(implicit, step_context=(100, 900))  # a placed document between the two steps
    assert cm.prefill(later, overlap=True).total_s > cm.prefill(implicit, overlap=True).total_s
    placed = dataclasses.replace(implicit, placed_tokens=500)
    assert cm.prefill(placed, overlap=True).total_s == pytest.approx(
        cm.prefill(implicit, overlap=True).total_s + cm.place_s(500))
    assert cm.place_s(500) > 0
    with pytest.raises(ValueError, match="one entry per compute step"):
        PrefillWork(cached_tokens=0, compute_steps=(1, 2), step_context=(0,))


def test_trace_builder_isolated_plans_are_the_engines_keys():
    root = namespace_key("m", "float16", CS)
    anchor = synthetic_tokens("anchor", 20)
    tb = TraceBuilder(root, CS, lambda d: synthetic_tokens(d, 37), system_tokens=synthetic_tokens("s", 9),
                      anchor_tokens=anchor)
    assert list(tb.isolated_plan("a")) == plan_chunks(blend_root(root), [anchor, synthetic_tokens("a", 37)], CS)
    req = tb.request(0, 0.0, ("a", "b"), 1)
    assert [(d.start, d.end) for d in req.documents] == [(9, 46), (46, 83)]
    assert req.documents[1].plan[:2] == req.documents[0].plan[:2]  # the anchor's chunks are shared


TRACE_LINES = [
    json.dumps({"timestamp": t, "output_length": 3, "segments": [
        {"kind": "system", "id": "sys", "tokens": 30},
        {"kind": "system", "id": f"ctx-{i}", "tokens": 10, "volatile": True},
        *({"kind": "passage", "id": p, "tokens": 120} for p in order),
        {"kind": "question", "id": f"q{i}", "tokens": 8}]})
    for i, (t, order) in enumerate([(0, "abc"), (1000, "cab"), (2000, "bca"), (3000, "cba"), (4000, "acb")])
]


def test_trace_requests_follow_the_bench_layout():
    trace = parse_trace(TRACE_LINES)
    tb = TraceBuilder(namespace_key("m", "float16", CS), CS, segment_tokens, system_tokens=synthetic_tokens("h", 5))
    reqs = trace_requests(trace, tb, trace.arrivals_s(2.0), default_output=7)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert all(r.output_tokens == 3 for r in reqs)
    first = reqs[0]
    assert first.prompt_tokens == 5 + 30 + 10 + 3 * 120 + 8
    assert [d.doc_id for d in first.documents][:3] == ["system/sys#30", "system/ctx-0#10", "passage/a#120"]
    # the same identity is the same tokens wherever it sits
    a_first = next(d for d in reqs[0].documents if d.doc_id == "passage/a#120")
    a_second = next(d for d in reqs[1].documents if d.doc_id == "passage/a#120")
    assert a_first.plan == a_second.plan and a_first.start != a_second.start
    assert segment_doc_id(trace.requests[0].segments[2]) == "passage/a#120"
    with pytest.raises(ValueError, match="arrival times"):
        trace_requests(trace, tb, [0.0], default_output=1)


def test_trace_replay_gives_blend_more_reuse_than_pcr():
    trace = parse_trace(TRACE_LINES)
    prof = _profile()
    ts = build_trace_scenario(trace, prof, ReplayOptions(chunk_size=CS, head_tokens=20, warmup=1, speed=math.inf))
    bounds = replay_bounds(ts)
    assert 0 < bounds.prefix < bounds.position_independent < 1
    from pcr_rag.sim.experiment import SimSettings

    systems = blend_variants([get_system(n) for n in ("no-reuse", "pcr", "pcr-blend")], (0.0, 1.0))
    assert [s.name for s in systems] == ["no-reuse", "pcr", "pcr-blend@r=0", "pcr-blend@r=1"]
    got = {s.system: s for s in replay_trace(prof, ts, systems, SimSettings(), chunk_size=CS)}
    assert got["no-reuse"].reused_fraction == 0
    assert got["pcr"].fraction(got["pcr"].exact_tokens) == pytest.approx(bounds.prefix)
    assert got["pcr-blend@r=0"].reused_fraction > got["pcr"].reused_fraction
    assert got["pcr-blend@r=1"].computed_tokens == got["pcr"].computed_tokens
    assert got["pcr-blend@r=1"].mean_ttft_s == pytest.approx(got["pcr"].mean_ttft_s)
    assert got["pcr-blend@r=1"].forward_steps == got["pcr"].forward_steps == len(trace.requests)


def test_simulate_trace_cli(tmp_path, capsys):
    from pcr_rag.cli import main

    args = ["simulate", "--trace", EXAMPLE, "--profile", "rtx4090-llama2-7b,h200-llama3-8b", "--requests", "12",
            "--trace-speed", "4", "--blend-recompute", "0.15"]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        assert main([*args, "--json", str(p), "--markdown", str(p.with_suffix(".md"))]) == 0
    a, b = (json.loads(p.read_text()) for p in paths)
    assert a["summaries"] == b["summaries"]  # deterministic
    names = [s["system"] for s in a["summaries"]]
    assert names == ["no-reuse", "pcr", "pcr-blend@r=0.15"] * 2
    by = {(s["profile"], s["system"]): s for s in a["summaries"]}
    for prof in ("rtx4090-llama2-7b", "h200-llama3-8b"):
        assert by[(prof, "pcr-blend@r=0.15")]["reused_fraction"] > by[(prof, "pcr")]["reused_fraction"]
        assert all(s["requests"] == 12 for s in a["summaries"])
    out = capsys.readouterr().out
    assert "| h200-llama3-8b | pcr-blend@r=0.15 |" in out and "position-independent" in out
    assert (tmp_path / "a.md").read_text().startswith("# pcr-rag simulate --trace")
    assert len(read_trace(EXAMPLE).requests) > 12
    assert main(["simulate", "--trace", EXAMPLE, "--trace-speed", "0", "--quiet"]) == 2
    assert main(["simulate", "--trace", EXAMPLE, "--fleet", "--quiet"]) == 2


def test_the_prefetch_window_loads_waiting_blend_requests_document_chains():
    """While a long request runs, a waiting blend request's document chain is brought back from SSD to DRAM (the
    runtime's window holds blend chains after a request's own keys), so it is placed with no isolated prefill;
    without prefetch the same request prefills it in isolation from the SSD. ("s" leads every request: the first
    new document after the exact match is computed in context, so "a" needs one before it to be placed.)"""
    docs = [("s", "a"), ("s", "x", "y", "z"), ("s", "long"), ("s", "a")]
    reqs = _reqs(docs, doc_tokens=4 * CS)
    reqs = [dataclasses.replace(r, arrival_s=t) for r, t in zip(reqs, [0.0, 10.0, 20.0, 20.0001], strict=True)]
    got = {}
    for name in ("pcr", "pcr-no-prefetch"):
        sim = _sim(_system(name, blend=True), dram_chunks=8)
        res = sim.run(reqs)
        got[name] = res.outcomes[3]
        if name == "pcr":
            assert res.counters["prefetch_loaded"] > 0
        sim.close()
    assert got["pcr"].isolated_tokens == 0 and got["pcr"].blended_tokens == got["pcr"].placed_tokens > 0
    assert got["pcr-no-prefetch"].isolated_tokens > 0
    assert got["pcr"].ttft_s < got["pcr-no-prefetch"].ttft_s
