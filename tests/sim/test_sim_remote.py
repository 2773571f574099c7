"""The simulator's remote tier and the two-replica experiment: a cold replica reuses what a warm one wrote to the
shared store when the link is fast, and recomputes (no slower than without the store) when it is not."""

from __future__ import annotations

import pytest

from pcr_rag.sim.experiment import SimSettings, SimWorkload, build_scenario
from pcr_rag.sim.profiles import get_profile
from pcr_rag.sim.remote_link import REMOTE_LINKS, RemoteLink, get_link
from pcr_rag.sim.replicas import two_replica_experiment


@pytest.fixture(scope="module")
def result():
    profile = get_profile("rtx4090-llama2-7b")
    wl = SimWorkload(num_requests=30, warmup_requests=16, num_passages=64, num_topics=None)
    scenario = build_scenario(wl, profile, 1)
    fast = RemoteLink("fast", 50e9, 20e-6)
    return two_replica_experiment(profile, scenario, SimSettings(), [fast, get_link("1gbe")], rate=0.5)


def test_a_cold_replica_reuses_a_warm_store_over_a_fast_link(result):
    cold = result["links"]["fast"]["cold_with_remote"]
    assert cold["reused_tokens"]["remote"] > 0 and cold["remote_read_bytes"] > 0
    assert cold["mean_ttft_s"] < 0.8 * result["cold_no_remote"]["mean_ttft_s"]


def test_over_a_slow_link_it_recomputes_instead(result):
    cold = result["links"]["1gbe"]["cold_with_remote"]
    assert cold["reused_tokens"]["remote"] == 0 and cold["recompute_chosen"] > 0
    assert cold["mean_ttft_s"] <= 1.01 * result["cold_no_remote"]["mean_ttft_s"]


def test_links():
    assert get_link("10gbe").fetch_s(1e9) == pytest.approx(1.0003)
    assert REMOTE_LINKS["loopback"].fetch_s(0) == 0.0
    with pytest.raises(ValueError, match="unknown remote link"):
        get_link("carrier-pigeon")
