"""The discrete-event simulator: timing math, queueing, batching, prefetch, and that it drives the real engine."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcr_rag.cache.keys import namespace_key
from pcr_rag.sim.costmodel import CostModel
from pcr_rag.sim.experiment import Scenario, SimSettings, hit_ratio_study, run_system
from pcr_rag.sim.profiles import get_profile
from pcr_rag.sim.simulator import SimConfig, Simulator
from pcr_rag.sim.systems import get_system
from pcr_rag.sim.trace import SimRequest, TraceBuilder, synthetic_tokens

CS = 16  # tokens per chunk in these tests


def _profile(**changes):
    prof = get_profile("rtx4090-llama2-7b")
    return dataclasses.replace(prof, **changes)


def _builder(doc_tokens: int = 2 * CS, question: int = 4) -> TraceBuilder:
    return TraceBuilder(namespace_key("t", "fp16", CS), CS, lambda d: synthetic_tokens(d, doc_tokens),
                        system_tokens=synthetic_tokens("sys", CS), question_tokens=question)


def _reqs(docs_per_req, arrivals, out=4, **kw) -> list[SimRequest]:
    tb = _builder(**kw)
    return [tb.request(i, t, docs, out) for i, (docs, t) in enumerate(zip(docs_per_req, arrivals, strict=True))]


def _sim(system: str, *, dram_chunks=1000, ssd_chunks=1000, max_batch=1, profile=None, **kw) -> Simulator:
    prof = profile or _profile()
    cb = CS * prof.kv_bytes_per_token
    return Simulator(SimConfig(prof, get_system(system), chunk_size=CS, dram_bytes=dram_chunks * cb,
                               ssd_bytes=ssd_chunks * cb, device_cache_bytes=int(prof.device_kv_bytes),
                               max_batch=max_batch, **kw))


def test_single_request_timing_is_the_cost_model():
    prof = _profile()
    cm = CostModel(prof)
    (req,) = _reqs([("a", "b")], [0.0])
    res = _sim("no-reuse").run([req])
    o = res.outcomes[0]
    assert o.ttft_s == pytest.approx(cm.compute_only_s((req.prompt_tokens,)))
    assert o.e2e_s == pytest.approx(o.ttft_s + cm.decode_s(req.prompt_tokens + 1, req.output_tokens - 1))
    assert o.queue_s == 0.0 and len(o.itl_s) == req.output_tokens - 1
    assert o.computed_tokens == req.prompt_tokens


def test_engine_steps_are_the_runtimes_prefill_steps():
    """``prefill_steps="engine"``: a cold prompt costs the runtime's steps (`prefill_step_sizes`: 256-token steps
    cut at its attention blocks), not one step per plan chunk."""
    from pcr_rag.model.forward import ATTENTION_BLOCK
    from pcr_rag.sched.runner import prefill_step_sizes

    cm = CostModel(_profile())
    (req,) = _reqs([("a", "b", "c", "d", "e", "f", "g", "h", "i", "j")], [0.0], doc_tokens=30 * CS)
    steps = prefill_step_sizes(0, req.prompt_tokens, 256, ATTENTION_BLOCK)
    assert len(steps) < len(req.plan) and sum(steps) == req.prompt_tokens
    engine = _sim("no-reuse", prefill_steps="engine").run([req]).outcomes[0]
    per_chunk = _sim("no-reuse", prefill_steps="per_chunk").run([req]).outcomes[0]
    assert engine.ttft_s == pytest.approx(cm.compute_only_s(tuple(steps)))
    assert per_chunk.ttft_s == pytest.approx(cm.compute_only_s(tuple(c.num_tokens for c in req.plan)))
    assert engine.ttft_s < per_chunk.ttft_s


def test_serial_queueing_and_reuse():
    reqs = _reqs([("a", "b"), ("a", "b")], [0.0, 0.0])
    res = _sim("dram-only").run(reqs)
    first, second = res.outcomes
    assert second.queue_s == pytest.approx(first.e2e_s)  # one request at a time
    # the second reuses everything but its question chunk (system + 2 docs = 5 chunks)
    assert second.reused["dram"] == 5 * CS and second.computed_tokens == reqs[1].prompt_tokens - 5 * CS
    assert second.prefill_s < first.prefill_s


def test_batched_decode_shares_steps():
    reqs = _reqs([("a",), ("b",)], [0.0, 0.0], out=6)
    res = _sim("no-reuse", max_batch=8, kv_pool_tokens=10_000).run(reqs)
    a, b = res.outcomes
    assert b.queue_s == pytest.approx(a.prefill_s)  # prefill-first: b starts before a decodes
    assert a.itl_s[-1] == pytest.approx(b.itl_s[-1])  # decoded in the same steps
    assert a.done_s == pytest.approx(b.done_s)


def test_prefetch_turns_ssd_hits_into_dram_hits():
    # DRAM holds 2 chunks: after [x][y] the shared prefix of "a" is only on SSD. While a long request runs, the
    # next "a" request waits in the queue and the prefetcher brings its chunks back to DRAM.
    docs = [("a",), ("x", "y", "z"), ("long",), ("a",)]
    reqs = _reqs(docs, [0.0, 10.0, 20.0, 20.0001])
    by_system = {}
    for name in ("pcr", "pcr-no-prefetch"):
        res = _sim(name, dram_chunks=3).run(reqs)
        by_system[name] = res.outcomes[3]
        if name == "pcr":
            assert res.counters["prefetch_loaded"] > 0
    assert by_system["pcr-no-prefetch"].reused["ssd"] > 0
    assert by_system["pcr"].reused["ssd"] == 0 and by_system["pcr"].reused["dram"] > 0
    assert by_system["pcr"].prefetch_hit_chunks > 0
    assert by_system["pcr"].prefill_s < by_system["pcr-no-prefetch"].prefill_s


def test_device_cache_gives_way_to_running_requests():
    prof = _profile()
    pool_tokens = 40 * CS
    prof = dataclasses.replace(prof, device_kv_bytes=pool_tokens * prof.kv_bytes_per_token)
    reqs = _reqs([(f"d{i}",) for i in range(20)], [0.0] * 20, out=3)
    sim = _sim("device-only", max_batch=8, kv_pool_tokens=pool_tokens, profile=prof)
    res = sim.run(reqs)
    hw = res.cache_stats.bytes_high_water["dram"]
    assert hw <= prof.device_kv_bytes
    assert sum(o.reused["device"] for o in res.outcomes) > 0  # the shared system chunk is reused on device


def test_simulation_follows_the_engine_policy(monkeypatch):
    """Swap the cache engine's eviction policy for MRU: the simulated hits change (the engine decides)."""
    import pcr_rag.cache.manager as engine_mod
    from pcr_rag.cache.policy import EvictionPolicy

    class MRU(EvictionPolicy):
        name = "mru"

        def candidates(self, order, protected):
            for node in reversed(order.ordered()):
                if node in order.leaves:
                    yield node

    docs = [(f"d{i % 5}",) for i in range(40)]
    reqs = _reqs(docs, [i * 0.01 for i in range(40)], doc_tokens=CS)
    base = _sim("dram-only", dram_chunks=4).run(reqs)
    monkeypatch.setattr(engine_mod, "make_policy", lambda name: MRU())
    mru = _sim("dram-only", dram_chunks=4).run(reqs)
    hits = [sum(o.reused["dram"] for o in r.outcomes) for r in (base, mru)]
    assert hits[0] != hits[1]


def _scenario(traces, dram_bytes):
    return Scenario([], traces, dram_bytes, 0, 0, 0.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    picks=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True), min_size=2, max_size=30),
    capacity=st.integers(1, 6),
    gap=st.sampled_from([0.0, 0.05, 1.0]),
)
def test_belady_bounds_the_engine_policies(picks, capacity, gap):
    """Belady (MIN) gets at least as many chunk hits as the real engine's LRU and look-ahead LRU, same trace."""
    prof = _profile()
    tb = TraceBuilder(namespace_key("t", "fp16", CS), CS, lambda d: synthetic_tokens(d, CS), question_tokens=1)
    reqs = [tb.request(i, i * gap, tuple(f"d{x}" for x in p), 2) for i, p in enumerate(picks)]
    cap = capacity * CS * prof.kv_bytes_per_token
    study = hit_ratio_study(prof, _scenario([reqs], cap), 0, 1.0, SimSettings(max_batch=1), window=4, chunk_size=CS)
    by = {r.policy: r for r in study.results}
    assert by["belady"].hit_chunks >= by["lru"].hit_chunks
    assert by["belady"].hit_chunks >= by["lookahead-lru"].hit_chunks
    assert by["belady"].total_tokens == by["lru"].total_tokens


def test_run_system_keeps_the_cache_across_rates():
    reqs = _reqs([("a",), ("a",)], [0.0, 1.0])
    sc = Scenario(reqs[:1], [reqs[1:], reqs[1:]], 10**12, 10**12, 0, 0.0)
    recs = run_system(_profile(), get_system("pcr"), sc, [1.0, 2.0], SimSettings(), chunk_size=CS)
    assert [r.rate for r in recs] == [1.0, 2.0]
    assert all(r.samples[0].reused_by_tier["dram"] > 0 for r in recs)  # warm-up filled the cache
    assert not math.isnan(recs[0].samples[0].ttft_s)


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_the_waiting_queue_is_admitted_in_the_runtimes_schedule_order(schedule):
    """The simulator admits with the runtime's own policy. X takes the executor; then L (one cold document) and
    A, B, C (the same two cold documents) queue. Under cache-aware the three rank by their group's work per request,
    less than L's although each has more work than L alone, so A, B, C (hits after A) go before L; under fcfs the
    queue goes in arrival order. Grouping lowers the mean TTFT."""
    docs = [("x",), ("z",), ("a", "b"), ("a", "b"), ("a", "b")]

    def run(system: str):
        return _sim(system).run(_reqs(docs, [0.0] * len(docs)))

    res = run(f"pcr-schedule-{schedule}")
    assert res.outcomes[1].computed_tokens < res.outcomes[2].prompt_tokens - CS  # L alone is less work than A
    order = sorted(range(len(docs)), key=lambda i: res.outcomes[i].start_s)
    assert order == ([0, 2, 3, 4, 1] if schedule == "cache-aware" else [0, 1, 2, 3, 4])
    if schedule == "cache-aware":
        fcfs = run("pcr-schedule-fcfs")
        assert sum(o.ttft_s for o in res.outcomes) < sum(o.ttft_s for o in fcfs.outcomes)


def test_the_default_pcr_system_uses_the_engines_default_schedule():
    from pcr_rag.config import EngineConfig

    assert get_system("pcr").schedule == EngineConfig().schedule
    assert get_system("pcr-schedule-fcfs").schedule == "fcfs" and get_system("device-only").schedule == "fcfs"


# ---------------------------------------------------------------------------------- the runtime's executor
def _host_profile(**changes):
    """A CPU-like profile: per-chunk prefill steps, decode steps that cost more per row."""
    return _profile(prefill_steps="per_chunk", device_is_host=True, **changes)


@pytest.mark.parametrize("system", ["no-reuse", "dram-only", "pcr"])
def test_engine_steps_with_one_row_is_the_serial_executor(system):
    docs = [("a", "b"), ("c",), ("a", "b"), ("b", "c"), ("a",)]
    reqs = _reqs(docs, [0.0, 0.001, 0.002, 0.5, 0.5])
    prof = _host_profile()
    serial = _sim(system, profile=prof).run(reqs)
    steps = _sim(system, profile=prof, executor="engine-steps").run(reqs)
    for a, b in zip(serial.outcomes, steps.outcomes, strict=True):
        assert b.first_token_s == pytest.approx(a.first_token_s, rel=1e-9)
        assert b.done_s == pytest.approx(a.done_s, rel=1e-9)
        assert b.reused == a.reused and b.computed_tokens == a.computed_tokens
        assert b.itl_s == pytest.approx(a.itl_s, rel=1e-9)
    for counter in ("compute_busy_s", "decode_steps", "ssd_read_bytes", "h2d_bytes", "d2h_bytes"):
        assert steps.counters[counter] == pytest.approx(serial.counters[counter], rel=1e-9), counter


def test_engine_steps_bound_the_gap_between_tokens_by_the_itl_budget():
    """A long cold prefill admitted while another request decodes runs a few layers per engine step: the decoding
    row's gaps stay within the budget (in decode steps), and without a budget one gap holds a whole prefill step.
    Like on a CPU, a decode step costs about a prefill step's fixed part (both stream the weights once)."""
    prof = _host_profile(layer_s_fixed=1e-3, layer_s_per_token=1e-3, step_s_fixed=0.0, decode_s_per_token=0.032,
                         decode_s_per_token_ctx=0.0)
    cm = CostModel(prof)
    reqs = _reqs([("short",), tuple(f"long{i}" for i in range(6))], [0.0, 0.05], out=40)
    gaps = {}
    for budget in (3.0, None):
        res = _sim("no-reuse", profile=prof, max_batch=8, executor="engine-steps", itl_budget_steps=budget).run(reqs)
        first, second = res.outcomes
        assert second.start_s < first.first_token_s  # a free row: admitted at the next engine step
        gaps[budget] = max(first.itl_s[1:])  # the first gap may hold the step measured before the budget knows
    decode = cm.decode_step_s(reqs[0].prompt_tokens + 1)
    assert gaps[3.0] <= 3.0 * decode * 1.05 + 1e-9
    assert gaps[None] > 3.0 * decode * 2


def test_engine_steps_decode_rows_together_and_pay_per_row():
    prof = _host_profile(decode_s_per_row=0.002)
    reqs = _reqs([("a",), ("b",)], [0.0, 0.0], out=6)
    res = _sim("no-reuse", profile=prof, max_batch=8, executor="engine-steps").run(reqs)
    a, b = res.outcomes
    assert b.start_s < a.first_token_s  # a free row: admitted while the first prefills
    assert b.first_token_s > a.first_token_s  # one prefill step per engine step
    assert res.counters["decode_steps"] < 2 * (6 - 1)  # some steps decode both rows
    cm = CostModel(prof)
    ctx = a.prompt_tokens + b.prompt_tokens + 6
    assert cm.decode_step_s(ctx, rows=2) == pytest.approx(cm.decode_step_s(ctx) + 0.002)
    assert b.itl_s[-1] == pytest.approx(cm.decode_step_s(b.prompt_tokens + 5))  # b alone at the end
    assert max(b.itl_s) >= cm.decode_step_s(ctx, rows=2) - 1e-12


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_engine_steps_prefills_wait_for_shared_chunks_and_reuse_them(schedule):
    """Two rows admitted at once on the same documents: the second waits for the chunks the first computes and
    reuses them (it would otherwise compute them twice), as the runtime's executor does."""
    prof = _host_profile()
    docs = ("x", "y", "z")
    reqs = _reqs([docs, docs], [0.0, 0.0])
    system = dataclasses.replace(get_system("dram-only"), schedule=schedule)
    cb = CS * prof.kv_bytes_per_token
    sim = Simulator(SimConfig(prof, system, chunk_size=CS, dram_bytes=1000 * cb, max_batch=8,
                              executor="engine-steps"))
    a, b = sim.run(reqs).outcomes
    assert a.reused["dram"] == 0 and b.reused["dram"] == 7 * CS  # system + 3 docs x 2 chunks
    assert b.first_token_s > a.first_token_s


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_engine_steps_a_short_prompt_overtakes_a_long_one_late_in_its_prefill(schedule):
    """A one-document prompt arrives when a lone 12-document prompt is 70% computed: under cache-aware the long
    prompt's computing does not count as waiting against the newcomer, so the short one (less work than the long
    one's remaining 30%) runs first; under fcfs the long one finishes first. As the runtime's `rank`."""
    prof = _host_profile()
    system = dataclasses.replace(get_system("no-reuse"), schedule=schedule)
    long_docs = tuple("abcdefghijkl")

    def run(arrivals, docs):
        sim = Simulator(SimConfig(prof, system, chunk_size=CS, max_batch=8, executor="engine-steps"))
        return sim.run(_reqs(docs, arrivals)).outcomes

    alone = run([0.0], [long_docs])[0].first_token_s
    long, short = run([0.0, 0.7 * alone], [long_docs, ("z",)])
    if schedule == "cache-aware":
        assert short.first_token_s < long.first_token_s
    else:
        assert long.first_token_s < short.first_token_s


def test_sim_config_rejects_an_unknown_executor():
    with pytest.raises(ValueError, match="executor"):
        SimConfig(_profile(), get_system("pcr"), executor="round-robin")


def test_settings_take_each_systems_own_executor():
    """Under engine-steps a bench system's own max_active / ITL budget replace the run's; the outside baselines
    (served one at a time with one-shot prefill by the bench) run serially whatever the run's executor."""
    prof = _host_profile()
    settings = SimSettings(max_batch=8, prefill_steps="per_chunk", executor="engine-steps")
    sc = _scenario([[]], 0)
    pcr = settings.config(prof, get_system("pcr"), sc)
    assert (pcr.executor_kind, pcr.max_batch, pcr.itl_budget_steps, pcr.steps_mode) == (
        "engine-steps", 8, 3.0, "per_chunk")
    one = settings.config(prof, get_system("pcr-max-active-1"), sc)
    assert (one.executor_kind, one.max_batch) == ("engine-steps", 1)
    whole = settings.config(prof, get_system("pcr-whole-steps"), sc)
    assert whole.itl_budget_steps is None and whole.max_batch == 8
    hf = settings.config(prof, get_system("transformers"), sc)
    assert (hf.executor_kind, hf.max_batch, hf.steps_mode) == ("serial", 1, "single")
    # a serial run is one request at a time whatever rows a system would have (more would batch like prefill-first)
    serial = dataclasses.replace(settings, max_batch=1, executor="serial")
    assert serial.config(prof, get_system("pcr-max-active-4"), sc).max_batch == 1
    with pytest.raises(ValueError, match="serial"):
        SimConfig(prof, get_system("pcr"), max_batch=4, executor="serial")


def test_engine_steps_prefetch_for_admitted_prefills_that_have_not_begun():
    """The runtime's prefetch window starts with the admitted requests whose prefill has not begun
    (`BatchExecutor.waiting_keys`), then the queue. An "a" request admitted to a row while a long cold prefill runs
    first (fcfs) has its SSD chunks brought back to DRAM before it begins."""
    docs = [("a",), ("x", "y", "z"), tuple(f"long{i}" for i in range(4)), ("a",)]
    reqs = _reqs(docs, [0.0, 10.0, 20.0, 20.0001])
    system = dataclasses.replace(get_system("pcr"), schedule="fcfs")
    prof = _host_profile()
    cb = CS * prof.kv_bytes_per_token
    sim = Simulator(SimConfig(prof, system, chunk_size=CS, dram_bytes=4 * cb, ssd_bytes=1000 * cb, max_batch=8,
                              executor="engine-steps"))
    res = sim.run(reqs)
    last = res.outcomes[3]
    assert last.start_s < res.outcomes[2].first_token_s  # admitted to a row while "long" prefills
    assert res.counters["prefetch_loaded"] > 0 and last.prefetch_hit_chunks > 0
    assert last.reused["ssd"] == 0 and last.reused["dram"] > 0
