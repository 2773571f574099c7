"""The pass/fail targets the benchmark reports check, in one place.

Every threshold is a named constant; the target lists below are built from them, so the text a report prints
("pcr mean TTFT <= 0.4x no-reuse") and the number it checks cannot drift apart. The README quotes these names.

- `SERVING_TARGETS`: ``pcr-rag bench`` (real engines on this machine), judged at the middle rate of the sweep.
- `LIMIT_RATIO_TARGETS`: the limit ratio (`pcr_rag.bench.limit`): cached TTFT over a raw forward of the same
  suffix over an already-resident cache, prefix in DRAM and prefix on SSD.
- `PAPER_TARGETS`: ``pcr-rag simulate`` (the GPU regime): the PCR paper's claims for Llama2-7B.
- ``SIM_VALIDATION_*``: ``pcr-rag simulate --validate``: how close the simulator must come to a measured run.

A ratio target passes when ``stat(system) / stat(baseline) <= max_ratio`` (lower is better: times).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "LIMIT_RATIO_DRAM_MAX",
    "LIMIT_RATIO_SSD_MAX",
    "LIMIT_RATIO_TARGETS",
    "PAPER_MIN_SPEEDUP_VS_NO_REUSE",
    "PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND",
    "PAPER_TARGETS",
    "PCR_VS_DRAM_ONLY_MEAN_TTFT_MAX",
    "PCR_VS_NO_REUSE_MEAN_TTFT_MAX",
    "PCR_VS_NO_REUSE_P99_TTFT_MAX",
    "PCR_VS_SSD_ON_DEMAND_MEAN_TTFT_MAX",
    "SERVER_ITL_OVERHEAD_MAX",
    "SERVER_LOAD_RSS_GROWTH_MAX",
    "SERVER_TTFT_OVERHEAD_MAX",
    "SERVING_TARGETS",
    "SIM_VALIDATION_MIN_RATES",
    "SIM_VALIDATION_SYSTEMS",
    "SIM_VALIDATION_TOLERANCE",
    "RatioTarget",
]


@dataclass(frozen=True)
class RatioTarget:
    """``stat(system) / stat(baseline) <= max_ratio`` at one rate (default: the sweep's middle rate).

    ``stat`` is a dotted path into a report run, e.g. ``"ttft.mean"`` or ``"ttft.p99"`` (seconds)."""

    name: str
    system: str
    baseline: str
    stat: str = "ttft.mean"
    max_ratio: float = 1.0


# ------------------------------------------------------------------------------------ pcr-rag serve

#: mean TTFT through `pcr-rag serve` over a local engine's, same requests, one run
#: (`python -m pcr_rag.bench.server_overhead`).
SERVER_TTFT_OVERHEAD_MAX = 1.1
#: mean inter-token latency through the server over a local engine's (same run).
SERVER_ITL_OVERHEAD_MAX = 1.1
#: the server's RSS after the last of identical load rounds over its RSS after the first, minus 1
#: (`python -m pcr_rag.bench.load_server`).
SERVER_LOAD_RSS_GROWTH_MAX = 0.05

# ------------------------------------------------------------------------------------ pcr-rag bench

#: pcr's mean TTFT over no-reuse's.
PCR_VS_NO_REUSE_MEAN_TTFT_MAX = 0.4
#: pcr's P99 TTFT over no-reuse's.
PCR_VS_NO_REUSE_P99_TTFT_MAX = 0.5
#: pcr's mean TTFT over dram-only's (a DRAM-only prefix cache with on-demand loads).
PCR_VS_DRAM_ONLY_MEAN_TTFT_MAX = 0.9
#: "not worse than ssd-on-demand": equal within 5%, the noise of a shared machine.
PCR_VS_SSD_ON_DEMAND_MEAN_TTFT_MAX = 1.05

SERVING_TARGETS: tuple[RatioTarget, ...] = (
    RatioTarget(f"pcr mean TTFT <= {PCR_VS_NO_REUSE_MEAN_TTFT_MAX:g}x no-reuse", "pcr", "no-reuse", "ttft.mean",
                PCR_VS_NO_REUSE_MEAN_TTFT_MAX),
    RatioTarget(f"pcr P99 TTFT <= {PCR_VS_NO_REUSE_P99_TTFT_MAX:g}x no-reuse", "pcr", "no-reuse", "ttft.p99",
                PCR_VS_NO_REUSE_P99_TTFT_MAX),
    RatioTarget(f"pcr mean TTFT <= {PCR_VS_DRAM_ONLY_MEAN_TTFT_MAX:g}x dram-only", "pcr", "dram-only", "ttft.mean",
                PCR_VS_DRAM_ONLY_MEAN_TTFT_MAX),
    RatioTarget(f"pcr not worse than ssd-on-demand (<= {PCR_VS_SSD_ON_DEMAND_MEAN_TTFT_MAX:g}x, noise)", "pcr",
                "ssd-on-demand", "ttft.mean", PCR_VS_SSD_ON_DEMAND_MEAN_TTFT_MAX),
)

# ------------------------------------------------------------------------------------ limit ratio

#: Cached TTFT with the prefix in DRAM over the raw forward over a resident cache.
LIMIT_RATIO_DRAM_MAX = 1.10
#: The same with the prefix only on SSD (page cache dropped).
LIMIT_RATIO_SSD_MAX = 1.25

#: `LimitRatioResult` field -> the largest value that passes.
LIMIT_RATIO_TARGETS: Mapping[str, float] = MappingProxyType(
    {"ratio_dram": LIMIT_RATIO_DRAM_MAX, "ratio_ssd": LIMIT_RATIO_SSD_MAX})

# ------------------------------------------------------------------------------------ pcr-rag simulate

#: Mean TTFT reduction of pcr vs ssd-on-demand the simulation must show (the paper reports 36.4%).
PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND = 0.36
#: Mean TTFT speed-up of pcr over no-reuse the simulation must show (the paper's figure).
PAPER_MIN_SPEEDUP_VS_NO_REUSE = 2.13

PAPER_TARGETS: tuple[RatioTarget, ...] = (
    RatioTarget(f"pcr vs ssd-on-demand: >= {PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND:.0%} lower mean TTFT "
                "(paper: 36.4%)", "pcr", "ssd-on-demand",
                max_ratio=round(1 - PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND, 12)),
    RatioTarget(f"pcr vs no-reuse: >= {PAPER_MIN_SPEEDUP_VS_NO_REUSE:g}x faster mean TTFT (paper)", "pcr",
                "no-reuse", max_ratio=1 / PAPER_MIN_SPEEDUP_VS_NO_REUSE),
)

#: Simulated mean TTFT must be within this fraction of the measured one ...
SIM_VALIDATION_TOLERANCE = 0.15
#: ... for each of these systems ...
SIM_VALIDATION_SYSTEMS: tuple[str, ...] = ("no-reuse", "dram-only", "pcr")
#: ... at this many rates of the bench run at least.
SIM_VALIDATION_MIN_RATES = 2
