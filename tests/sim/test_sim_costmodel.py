"""Cost model sanity: per-layer pipeline math, overlap never slower, monotonic in tokens, profiles."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcr_rag.bench.model_shapes import MODELS
from pcr_rag.sim.costmodel import CostModel, PrefillWork, pipeline, pipeline_uniform
from pcr_rag.sim.profiles import Profile, ProfileError, get_profile, shipped_profile_names


def test_three_layer_pipeline_by_hand():
    # load 1, compute 2, offload 1 per layer. Loads end at 1, 2, 3; compute runs [1,3] [3,5] [5,7];
    # offloads [3,4] [5,6] [7,8]. Serial: 3 + 6 + 3 = 12.
    r = pipeline([1, 1, 1], [2, 2, 2], [1, 1, 1], overlap=True)
    assert r.compute_end_s == pytest.approx(7.0)
    assert r.offload_end_s == pytest.approx(8.0)
    assert r.done_s == pytest.approx(8.0)
    assert r.stall_s == pytest.approx(1.0)
    assert pipeline([1, 1, 1], [2, 2, 2], [1, 1, 1], overlap=False).done_s == pytest.approx(12.0)


def test_three_layer_pipeline_load_bound_and_uneven():
    # loads 3 each, compute 1 each: compute waits for every layer: [3,4] [6,7] [9,10].
    r = pipeline([3, 3, 3], [1, 1, 1], [0, 0, 0], overlap=True)
    assert r.compute_end_s == pytest.approx(10.0)
    assert r.stall_s == pytest.approx(7.0)
    # uneven layers: loads end 1, 4, 5; compute [1,3] [4,5] [5,7]; offloads (2 each) [3,5] [5,7] [7,9].
    r = pipeline([1, 3, 1], [2, 1, 2], [2, 2, 2], overlap=True)
    assert (r.compute_end_s, r.offload_end_s) == (pytest.approx(7.0), pytest.approx(9.0))
    # post-layer compute (LM head) runs alongside the last offload
    assert pipeline([1, 3, 1], [2, 1, 2], [2, 2, 2], overlap=True, post_s=1.5).done_s == pytest.approx(9.0)
    assert pipeline([1, 3, 1], [2, 1, 2], [2, 2, 2], overlap=True, post_s=2.5).done_s == pytest.approx(9.5)


times = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), ld=times, c=times, o=times, start=times, post=times, sync=times)
def test_closed_form_equals_layer_loop(n, ld, c, o, start, post, sync):
    for overlap in (True, False):
        a = pipeline_uniform(n, ld, c, o, overlap=overlap, sync_s=sync, load_start=start, post_s=post)
        b = pipeline([ld] * n, [c] * n, [o] * n, overlap=overlap, sync_s=sync, load_start=start, post_s=post)
        assert a.done_s == pytest.approx(b.done_s, rel=1e-9, abs=1e-9)
        assert a.compute_end_s == pytest.approx(b.compute_end_s, rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(times, times, times), min_size=1, max_size=10), times)
def test_overlap_never_slower_than_serial(layers, start):
    load, comp, off = (list(x) for x in zip(*layers, strict=True))
    ov = pipeline(load, comp, off, overlap=True, load_start=start)
    serial = pipeline(load, comp, off, overlap=False, load_start=start)
    assert ov.done_s <= serial.done_s + 1e-9


@settings(max_examples=100, deadline=None)
@given(
    cached=st.integers(0, 4096), computed=st.integers(1, 4096), ssd_frac=st.floats(0, 1),
    name=st.sampled_from(shipped_profile_names()),
)
def test_prefill_overlap_never_slower_with_zero_sync(cached, computed, ssd_frac, name):
    prof = get_profile(name)
    cm = CostModel(Profile.from_dict({**json.loads(prof.to_json()), "layer_sync_s": 0.0}))
    ssd = int(cached * ssd_frac)
    work = PrefillWork(cached_tokens=cached, compute_steps=(computed,), dram_tokens=cached - ssd, ssd_tokens=ssd,
                       ssd_chunks=(ssd + 255) // 256, promote_tokens=ssd)
    assert cm.prefill(work, overlap=True).total_s <= cm.prefill(work, overlap=False).total_s + 1e-12


def test_costs_monotonic_in_tokens():
    cm = CostModel(get_profile("rtx4090-llama2-7b"))
    xs = [0, 1, 64, 256, 1024, 4096]
    comp = [cm.compute_only_s((n,)) for n in xs]
    assert comp == sorted(comp) and comp[-1] > comp[1] > 0
    dec = [cm.decode_s(n, 32) for n in xs]
    assert dec == sorted(dec) and dec[0] > 0
    # more computed tokens (same cached prefix) -> slower; more of the prompt cached -> faster
    pre = [cm.prefill(PrefillWork(512, (n,), dram_tokens=512), overlap=True).total_s for n in xs[1:]]
    assert pre == sorted(pre)
    total = 4096
    reuse = [cm.prefill(PrefillWork(k, (total - k,), dram_tokens=k), overlap=True).total_s
             for k in (0, 1024, 2048, 3072)]
    assert reuse == sorted(reuse, reverse=True)
    # an SSD-resident prefix costs more than the same prefix in DRAM
    dram = cm.prefill(PrefillWork(2048, (2048,), dram_tokens=2048), overlap=False).total_s
    ssd = cm.prefill(PrefillWork(2048, (2048,), ssd_tokens=2048, ssd_chunks=8), overlap=False).total_s
    assert ssd > dram


def test_per_chunk_steps_cost_more_than_one_step():
    cm = CostModel(get_profile("rtx4090-llama2-7b"))
    one = cm.compute_only_s((1024,))
    four = cm.compute_only_s((256, 256, 256, 256))
    assert four > one  # fixed per-step/per-layer overheads are paid four times


def test_kv_bytes_per_token_from_model_configs():
    expect = {"llama2-7b": 524288, "llama2-13b": 819200, "qwen2.5-7b": 57344, "qwen2.5-14b": 196608,
              "llama3-8b": 131072}
    assert {k: MODELS[k].kv_bytes_per_token for k in expect} == expect
    assert get_profile("rtx4090-llama2-7b").kv_bytes_per_token == 524288
    assert get_profile("h200-llama3-8b").kv_bytes_per_token == 131072


def test_profile_json_roundtrip_and_errors(tmp_path):
    prof = get_profile("h200-llama3-8b")
    path = prof.save(tmp_path / "p.json")
    assert get_profile(path) == prof
    with pytest.raises(ProfileError, match="rtx4090-llama2-7b"):
        get_profile("no-such-profile")
    with pytest.raises(ProfileError, match="does not exist"):
        get_profile(tmp_path / "missing.json")
    bad = json.loads(prof.to_json())
    bad["bogus"] = 1
    with pytest.raises(ProfileError, match="unknown profile fields"):
        Profile.from_dict(bad)
    bad = json.loads(prof.to_json())
    bad["h2d_bytes_per_s"] = 0
    with pytest.raises(ProfileError, match="h2d_bytes_per_s"):
        Profile.from_dict(bad)


@settings(max_examples=40, deadline=None)
@given(cached=st.integers(0, 2048), steps=st.lists(st.integers(1, 512), min_size=1, max_size=6),
       ssd=st.integers(0, 1024), promote=st.booleans(), overlap=st.booleans())
def test_prefill_step_seconds_sum_to_the_total(cached, steps, ssd, promote, overlap):
    """`PrefillCost.step_s` has one entry per forward step and sums to ``total_s`` (the engine-steps executor
    spreads a prefill over engine steps with it); the first carries the request overhead."""
    prof = get_profile("rtx4090-llama2-7b")
    cm = CostModel(prof)
    work = PrefillWork(cached_tokens=cached + ssd, compute_steps=tuple(steps), dram_tokens=cached, ssd_tokens=ssd,
                       ssd_chunks=(ssd + 255) // 256, promote_tokens=ssd if promote else 0)
    cost = cm.prefill(work, overlap=overlap)
    assert len(cost.step_s) == len(steps)
    assert sum(cost.step_s) == pytest.approx(cost.total_s, rel=1e-12)
    assert all(s > 0 for s in cost.step_s)
    alone = cm.prefill(PrefillWork(cached_tokens=0, compute_steps=(steps[0],), offload=True), overlap=overlap)
    assert alone.step_s[0] >= prof.request_overhead_s


def test_loads_that_share_the_forwards_cores_are_not_hidden_by_the_pipeline():
    """A CPU profile (`loads_share_compute`): overlapped loads cost what serial ones do; without the flag the
    overlapped prefill is cheaper."""
    import dataclasses

    prof = get_profile("rtx4090-llama2-7b")
    work = PrefillWork(cached_tokens=2048, compute_steps=(256,), dram_tokens=1024, ssd_tokens=1024, ssd_chunks=4)
    free = CostModel(prof)
    assert free.prefill(work, overlap=True).total_s < free.prefill(work, overlap=False).total_s
    shared = CostModel(dataclasses.replace(prof, loads_share_compute=True))
    assert shared.prefill(work, overlap=True).total_s == pytest.approx(shared.prefill(work, overlap=False).total_s)
