"""The admission bound: FCFS and SRPT flow times on one machine, and the bound a report's fcfs run gives."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pcr_rag.bench.report import RequestSample, RunRecord, build_report
from pcr_rag.bench.schedule_bound import (
    CACHE_AWARE_SYSTEM,
    DRIFT_MARGIN,
    FCFS_SYSTEM,
    fcfs_flow_times,
    schedule_bound,
    schedule_bounds,
    seconds_per_computed_token,
    srpt_flow_times,
    target_note,
)


def test_fcfs_queues_in_arrival_order():
    # job 1 arrives during job 0 and waits for it; job 2 arrives to an idle machine
    assert fcfs_flow_times([0.0, 0.5, 5.0], [1.0, 0.1, 0.2]) == pytest.approx([1.0, 0.6, 0.2])
    # arrival order, not list order
    assert fcfs_flow_times([1.0, 0.0], [1.0, 2.0]) == pytest.approx([2.0, 2.0])


def test_srpt_preempts_the_longer_job():
    # the short job preempts the long one: 0.1 s instead of 0.6 s, the long one ends 0.1 s later
    assert srpt_flow_times([0.0, 0.5], [1.0, 0.1]) == pytest.approx([1.1, 0.1])
    # equal remaining work: the earlier arrival keeps the machine
    assert srpt_flow_times([0.0, 0.5], [1.0, 0.5]) == pytest.approx([1.0, 1.0])


def _nonpreemptive(arrivals, works, order):
    """Flow times serving jobs in ``order`` to the end, never idling while a job waits in that order."""
    free, out = 0.0, [0.0] * len(works)
    for i in order:
        free = max(free, arrivals[i]) + works[i]
        out[i] = free - arrivals[i]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_srpt_is_no_worse_than_any_order(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    arrivals = [rng.uniform(0, 2) for _ in range(n)]
    works = [rng.choice([0.0, rng.uniform(0.05, 1.5)]) for _ in range(n)]
    best = sum(srpt_flow_times(arrivals, works))
    assert best <= sum(fcfs_flow_times(arrivals, works)) + 1e-9
    for order in itertools.permutations(range(n)):
        assert best <= sum(_nonpreemptive(arrivals, works, order)) + 1e-9
    # every job is served exactly its work: flow >= work, and the last completion is the FCFS makespan
    flows = srpt_flow_times(arrivals, works)
    assert all(f >= w - 1e-12 for f, w in zip(flows, works, strict=True))
    assert max(a + f for a, f in zip(arrivals, flows, strict=True)) == pytest.approx(
        max(a + f for a, f in zip(arrivals, fcfs_flow_times(arrivals, works), strict=True)))


def test_bound_of_a_trace_without_overlap_is_one():
    b = schedule_bound([0.0, 2.0, 4.0], [0.5, 0.3, 1.0], rate=0.5, measured_ttft=[0.6, 0.4, 1.1])
    assert b.ratio == 1.0 and b.overlapping == 0 and b.requests == 3
    assert b.measured_fcfs_mean_s == pytest.approx(0.7)
    assert b.as_dict()["speed_ratio"] is None and math.isnan(b.speed_ratio)  # no run to compare: null in JSON
    assert "below 1.000x FCFS" in b.line() and "0 of 3 requests" in b.line()


def test_bound_counts_waiting_requests_and_the_gain():
    b = schedule_bound([0.0, 0.5], [1.0, 0.1])
    assert b.overlapping == 1
    assert b.fcfs_mean_s == pytest.approx((1.0 + 0.6) / 2) and b.best_mean_s == pytest.approx((1.1 + 0.1) / 2)
    assert b.ratio == pytest.approx(1.2 / 1.6)
    assert b.as_dict()["ratio"] == pytest.approx(b.ratio) and b.as_dict()["line"] == b.line()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2 arrivals but 1 works"):
        fcfs_flow_times([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        srpt_flow_times([0.0], [math.inf])
    with pytest.raises(ValueError, match="finite"):
        srpt_flow_times([0.0], [-1.0])


def _sample(arrival: float, work: float, ttft: float, key: tuple[int, int]) -> RequestSample:
    return RequestSample(ttft_s=ttft, e2e_s=ttft + 0.1, queue_s=ttft - work, itl_s=(0.1,), prompt_tokens=10,
                         computed_tokens=10, reused_by_tier={}, output_tokens=2, key=key, arrival_s=arrival,
                         prefill_compute_s=work, prefill_s=ttft)


def test_bounds_from_a_report_simulate_each_repeat_on_its_own():
    # two repeats of the same two-request trace: simulated apart, the second never queues behind the first's jobs
    rep0 = [_sample(0.0, 1.0, 1.0, (0, 0)), _sample(0.5, 0.1, 0.6, (0, 1))]
    rep1 = [_sample(0.0, 1.0, 1.0, (1, 0)), _sample(0.5, 0.1, 0.6, (1, 1))]
    # the cache-aware run computed the same work at half the seconds per token (machine speed, not the order)
    fast = [_sample(x.arrival_s, x.prefill_compute_s / 2, x.ttft_s / 2, x.key) for x in rep0 + rep1]
    runs = [RunRecord(FCFS_SYSTEM, 0.5, rep0, 2.0), RunRecord(FCFS_SYSTEM, 0.5, rep1, 2.0),
            RunRecord("pcr", 0.5, fast, 2.0),
            RunRecord(FCFS_SYSTEM, math.inf, rep0, 2.0)]  # saturation: not a rate slot
    report = build_report(runs, kind="bench", aliases={CACHE_AWARE_SYSTEM: "pcr"})
    (b,) = schedule_bounds(report)
    assert b.rate == 0.5 and b.requests == 4 and b.overlapping == 2
    assert b.ratio == pytest.approx(1.2 / 1.6)
    assert b.measured_fcfs_mean_s == pytest.approx(0.8)
    assert b.speed_ratio == pytest.approx(0.5) and "computed at 0.50x" in b.line()
    assert math.isnan(schedule_bounds(report, compare="no-such-system")[0].speed_ratio)
    assert schedule_bounds(report, system="no-such-system") == []


def test_seconds_per_computed_token_leaves_reused_tokens_out():
    reused = RequestSample(ttft_s=0.2, e2e_s=0.3, queue_s=0.0, itl_s=(0.1,), prompt_tokens=100, computed_tokens=20,
                           reused_by_tier={"dram": 80}, output_tokens=2, key=(0, 0), prefill_compute_s=0.2)
    report = build_report([RunRecord(FCFS_SYSTEM, 0.5, [reused], 1.0)], kind="bench")
    assert seconds_per_computed_token(report["runs"][0]) == pytest.approx(0.2 / 20)


def test_target_note_says_when_no_order_can_meet_the_target_and_when_drift_made_the_ratio():
    target = {"name": "cache-aware <= 0.85x fcfs", "ratio": 0.71, "max_ratio": 0.85}
    bound = {"ratio": 0.914, "speed_ratio": 0.80}
    note = target_note(target, bound)
    assert "unreachable on this trace" in note and "0.914x" in note and "measured 0.71x" in note
    assert "machine's speed" in note and "at 0.80x" in note
    # within the margin of the bound: unreachable, but no blame on drift
    near = target_note({**target, "ratio": 0.914 - DRIFT_MARGIN / 2}, bound)
    assert "unreachable" in near and "machine's speed" not in near
    # a reachable target: a note only when the measured ratio beats every order by more than the margin
    assert target_note({**target, "ratio": 0.70}, {"ratio": 0.8, "speed_ratio": None}).endswith("not the order")
    assert target_note({**target, "ratio": 0.79}, {"ratio": 0.8, "speed_ratio": None}) is None
    assert target_note(target, None) is None and target_note({**target, "ratio": None}, bound) is None
