"""The systems the simulator compares, derived from ``pcr-rag bench``'s own table (`pcr_rag.bench.systems`).

A bench system is a set of `EngineConfig` overrides; the simulator reads the same overrides (on top of
`EngineConfig`'s defaults) so a system means the same thing in both. One more system exists only here:
``device-only``, vLLM's automatic prefix caching (the cache lives in the GPU's KV pool), which the CPU bench cannot
have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pcr_rag.bench import systems as bench_systems
from pcr_rag.bench.systems import UnknownSystemError
from pcr_rag.config import EngineConfig

__all__ = ["DEFAULT_SYSTEMS", "SIM_ONLY_SYSTEMS", "SimSystem", "UnknownSystemError", "get_system", "parse_systems"]


def _engine_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def engine_default(name: str) -> Any:
    """`EngineConfig`'s default for the field ``name`` (what a system without that override runs)."""
    return _engine_defaults()[name]


@dataclass(frozen=True)
class SimSystem:
    """One serving system, as the simulator needs it.

    - ``reuse``: any prefix cache at all (False: plain prefill, no transfers).
    - ``device_cache``: the cache lives in device memory (vLLM-like): hits cost no transfer, nothing is offloaded.
    - ``ssd``: a DRAM + SSD hierarchy (else one tier).
    - ``overlap``: layer-wise pipelining of loads/offloads with compute (else load all, compute, offload all).
    - ``prefetch``: SSD -> DRAM loads for requests in the look-ahead window.
    - ``lookahead``: protect the window's chunks from eviction (look-ahead LRU; else plain LRU).
    - ``window``: look-ahead window in requests.
    - ``schedule``: admission order of the waiting queue, the runtime's own policy (`pcr_rag.sched.admission`:
      ``fcfs`` or ``cache-aware``); the look-ahead window follows it.
    - ``executor_overrides``: how the system itself executes, where that differs from the run's settings: its own
      ``max_active`` / ``itl_budget_steps`` (``pcr-max-active-N``, ``pcr-whole-steps``: the ``engine-steps``
      executor uses them), and for the outside baselines (``transformers``, ``llama-cpp``: the bench serves them
      one request at a time with one-shot prefill) ``executor="serial"`` and ``prefill_steps="single"``.
    - ``blend``: blend mode (``EngineConfig.reuse="blend"``, `pcr_rag.sched.blend`): after the exact prefix
      match, documents are placed from their position-independent KV (modelled by `pcr_rag.sim.simulator`);
      ``blend_recompute`` is the fraction of each placed document's first tokens computed in context.
    """

    name: str
    description: str = ""
    reuse: bool = True
    device_cache: bool = False
    ssd: bool = True
    overlap: bool = True
    prefetch: bool = True
    lookahead: bool = True
    window: int = 6
    schedule: str = "fcfs"
    executor_overrides: tuple[tuple[str, Any], ...] = ()
    blend: bool = False
    blend_recompute: float = engine_default("blend_recompute")

    def __post_init__(self) -> None:
        if not 0.0 <= self.blend_recompute <= 1.0:
            raise ValueError(f"blend_recompute must be a fraction in [0, 1], got {self.blend_recompute}")

    @property
    def policy(self) -> str:
        return "lookahead-lru" if self.lookahead else "lru"

    @property
    def uses_window(self) -> bool:
        return self.window > 0 and ((self.prefetch and self.ssd) or self.lookahead)


EXECUTOR_FIELDS = ("max_active", "itl_budget_steps")  # engine settings the engine-steps executor models


def from_bench(spec: bench_systems.SystemSpec) -> SimSystem:
    """The simulator's reading of a bench system's `EngineConfig` overrides."""
    cfg = {**_engine_defaults(), **dict(spec.overrides)}
    ssd = cfg.get("ssd_capacity") != 0
    return SimSystem(
        name=spec.name,
        description=spec.description,
        reuse=bool(cfg["enable_cache"]),
        ssd=ssd,
        overlap=bool(cfg["layerwise"]),
        prefetch=bool(cfg["prefetch"]) and ssd,
        lookahead=cfg["eviction"] == "lookahead-lru",
        window=int(cfg["prefetch_window"]),
        schedule=str(cfg["schedule"]),
        executor_overrides=tuple(_executor_overrides(spec).items()),
        blend=bool(cfg["enable_cache"]) and cfg["reuse"] == "blend",
        blend_recompute=float(cfg["blend_recompute"]),
    )


def _executor_overrides(spec: bench_systems.SystemSpec) -> dict[str, Any]:
    own = {k: spec.overrides[k] for k in EXECUTOR_FIELDS if k in spec.overrides}
    if spec.kind != "engine":  # `pcr_rag.bench.baselines`: a SerialServer, one-shot prefill
        own.update(executor="serial", prefill_steps="single")
    return own


SIM_ONLY_SYSTEMS: dict[str, SimSystem] = {
    "device-only": SimSystem(
        "device-only", "vLLM-like automatic prefix caching in the device KV pool (LRU, no host tiers, FCFS)",
        device_cache=True, ssd=False, overlap=False, prefetch=False, lookahead=False, window=0,
    ),
}

#: The simulator's default comparison: the bench's systems plus device-only.
DEFAULT_SYSTEMS: tuple[str, ...] = ("no-reuse", "device-only", *bench_systems.DEFAULT_SYSTEMS[1:])


def get_system(name: str) -> SimSystem:
    """A system by name: a bench system, ``pcr-window-N``, or a simulator-only one (``device-only``)."""
    if name in SIM_ONLY_SYSTEMS:
        return SIM_ONLY_SYSTEMS[name]
    try:
        return from_bench(bench_systems.get_system(name))
    except UnknownSystemError:
        raise UnknownSystemError(
            f"unknown system {name!r}; known: {', '.join(DEFAULT_SYSTEMS)}, or pcr-window-N"
        ) from None


def parse_systems(names: str | list[str] | None, windows: list[int] | tuple[int, ...] = ()) -> list[SimSystem]:
    """Systems from a comma-separated string or a list (None = :data:`DEFAULT_SYSTEMS`), plus ``pcr-window-N``
    per window; duplicates dropped, order kept (the same parsing as the bench)."""
    return [get_system(n) for n in bench_systems.system_names(names, windows, DEFAULT_SYSTEMS)]
