"""The two-replica experiment: what a shared remote tier buys a cold replica, per network link.

Replica A (pcr with the remote tier) serves the warm-up trace and then the measured trace, writing every chunk
through to a shared in-process store. Replica B starts cold (empty DRAM and SSD) behind the same store and serves
the measured trace; the baseline is the same cold replica without the remote tier. Every run uses the real cache
engine (lookups, write-through, the load-or-recompute decision fed with the link's and the profile's speeds) on
the virtual clock; transfers and compute are timed by the cost model (`pcr_rag.sim.simulator`).
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.sim.experiment import Scenario, SimSettings, at_rate
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.remote_link import RemoteLink
from pcr_rag.sim.simulator import SimResult, Simulator
from pcr_rag.sim.systems import get_system

__all__ = ["two_replica_experiment"]


def replica_summary(res: SimResult) -> dict[str, Any]:
    ttft = [o.ttft_s for o in res.outcomes]
    reused = {t: sum(o.reused.get(t, 0) for o in res.outcomes) for t in ("device", "dram", "ssd", "remote")}
    prompt = sum(o.prompt_tokens for o in res.outcomes)
    io = res.cache_stats.remote_io if res.cache_stats is not None else {}
    return {
        "mean_ttft_s": statistics.fmean(ttft) if ttft else math.nan,
        "p95_ttft_s": sorted(ttft)[int(0.95 * (len(ttft) - 1))] if ttft else math.nan,
        "reused_tokens": reused,
        "reuse_ratio": sum(reused.values()) / prompt if prompt else 0.0,
        "remote_read_bytes": res.counters.get("remote_read_bytes", 0.0),
        "remote_read_s": res.counters.get("remote_read_s", 0.0),
        "recompute_chosen": io.get("recompute_chosen", 0),
    }


def _serve(config, traces: Sequence[Sequence]) -> SimResult:
    sim = Simulator(config)
    try:
        result = None
        for trace in traces:
            result = sim.run(trace)
        assert result is not None
        return result
    finally:
        sim.close()


def two_replica_experiment(profile: Profile, scenario: Scenario, settings: SimSettings,
                           links: Sequence[RemoteLink], *, rate: float, slot: int = 0,
                           chunk_size: int = 256) -> dict[str, Any]:
    """Mean TTFT of a cold replica behind a warm shared store, per link, against the same cold replica without
    the remote tier (see the module docstring)."""
    system = get_system("pcr")
    trace = at_rate(scenario.traces[slot], rate)
    warmup = at_rate(scenario.warmup, math.inf)
    base = settings.config(profile, system, scenario, chunk_size=chunk_size)
    off = replica_summary(_serve(base, [trace]))
    out: dict[str, Any] = {"profile": profile.name, "rate": rate, "requests": len(trace), "cold_no_remote": off,
                           "links": {}}
    for link in links:
        store = f"sim-replicas-{uuid.uuid4().hex}"
        cfg = replace(base, remote=link, remote_store=store)
        try:
            _serve(cfg, [warmup, trace] if warmup else [trace])  # replica A warms the store
            cold = replica_summary(_serve(cfg, [trace]))  # replica B: empty local tiers, warm store
        finally:
            MemoryRemoteStore.forget(store)
        cold["ttft_over_no_remote"] = cold["mean_ttft_s"] / off["mean_ttft_s"] if off["mean_ttft_s"] else math.nan
        out["links"][link.name] = {"bytes_per_s": link.bytes_per_s, "rtt_s": link.rtt_s, "cold_with_remote": cold}
    return out
