"""The systems a benchmark compares, as `EngineConfig` field overrides (no engine import: the simulator reuses them).

======================== ==================================================================================
no-reuse                 plain chunk-aligned prefill, no cache at all (the vLLM-without-prefix-cache analog)
dram-only                prefix cache in DRAM only, on-demand (no SSD tier, no overlap, no prefetch, LRU; CCache)
ssd-on-demand            DRAM + SSD, synchronous loads, no overlap, no prefetch, LRU (paper's SCCache, LMCache-like)
pcr                      everything: DRAM + SSD, layer-wise overlap, queue prefetch, look-ahead LRU
pcr-no-overlap           pcr with ``layerwise=False``
pcr-no-prefetch          pcr with ``prefetch=False`` (look-ahead protection stays)
pcr-lru                  pcr with plain LRU eviction (no look-ahead protection)
pcr-whole-steps          pcr with ``itl_budget_steps=None``: prefill steps run whole between two decode steps
                         (the ITL budget's A/B; not in the default set)
pcr-always-load          pcr with ``load_planner="always-load"``: every cached chunk loaded, however slow its tier
                         (the load-or-recompute planner's A/B; not in the default set)
transformers             not a `PCREngine`: plain transformers ``model.generate`` on the whole prompt (one-shot
                         prefill, no reuse), one request at a time; what LlamaIndex's ``HuggingFaceLLM`` gives
llama-cpp                not a `PCREngine`: llama-cpp-python on the model's GGUF file with a one-slot
                         ``LlamaRAMCache``, one request at a time; only when ``llama_cpp`` is importable
pcr-window-N             pcr with ``prefetch_window=N`` (the window sweep)
pcr-max-active-N         pcr with ``max_active=N`` (the saturation comparison)
pcr-schedule-S           pcr with ``schedule=S`` (``fcfs`` or ``cache-aware``; needs an engine with that option)
<cached system>@O        that system with document order ``O`` (``relevance`` or ``cache-aware``) instead of
                         the run's ``--order``
pcr-blend                pcr with ``reuse="blend"``: documents after the exact prefix are placed from their
                         position-independent KV (approximate; `pcr_rag.sched.blend`; not in the default set)
pcr-cold                 pcr as a cold replica: empty DRAM and SSD before every measured run, no warm-up
pcr-remote               pcr-cold behind a shared Valkey that a first replica warmed with the warm-up trace
                         (``remote="warm"``)
pcr-remote-down          pcr-cold with a remote tier whose server is down (``remote="down"``: nothing listens)
======================== ==================================================================================

The last three are not in the default set; they compare a new replica with and without a shared remote tier.

Tier capacities are not part of a system: the runner sets them from the workload's working set, the same for all
(except that ``dram-only`` has no SSD tier). A system whose overrides name an `EngineConfig` field the engine
does not have is skipped by the runner, with the reason in the report. For tools that read only the overrides
(the simulator), both non-engine systems read as plain prefill without reuse (``enable_cache=False``):
llama.cpp's one-slot prompt cache is not modelled there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "ABLATION_SYSTEMS",
    "BASELINE_SYSTEMS",
    "BENCH_DEFAULT_SYSTEMS",
    "DEFAULT_SYSTEMS",
    "EXTERNAL_SYSTEMS",
    "ORDERS",
    "SCHEDULE_SYSTEMS",
    "SYSTEMS",
    "SystemSpec",
    "UnknownSystemError",
    "get_system",
    "max_active_variant",
    "parse_systems",
    "window_variant",
]

SystemKind = Literal["engine", "transformers", "llama-cpp"]
#: Document orders for the cached systems: as retrieved, or the order with the longest cached prefix.
ORDERS: tuple[str, ...] = ("relevance", "cache-aware")


class UnknownSystemError(ValueError):
    """A system name that is neither a known system nor a ``pcr-window-N`` / ``pcr-max-active-N`` /
    ``pcr-schedule-S`` variant, optionally with an ``@order`` suffix."""


@dataclass(frozen=True)
class SystemSpec:
    """One compared system: a name, what it is, the `EngineConfig` fields it sets, what runs it (``kind``: a
    `PCREngine`, or an outside baseline) and its document order (None: the run's ``--order``)."""

    name: str
    description: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    kind: SystemKind = "engine"
    order: str | None = None
    remote: str | None = None  # "warm": behind the run's shared store; "down": a remote URL nobody answers
    cold: bool = False  # fresh, empty local tiers before every measured run, no warm-up

    @property
    def uses_cache(self) -> bool:
        """True for a `PCREngine` with its KV cache on (the systems a document order applies to)."""
        return self.kind == "engine" and bool(self.overrides.get("enable_cache", True))

    @property
    def uses_ssd(self) -> bool:
        return self.uses_cache and self.overrides.get("ssd_capacity", None) != 0

    def config_kwargs(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``base`` (shared fields: cache_dir, capacities, chunk_size, ...) with this system's overrides on top."""
        kwargs = dict(base or {})
        kwargs.update(self.overrides)
        return kwargs


def _spec(name: str, description: str, kind: SystemKind = "engine", *, remote: str | None = None,
          cold: bool = False, **overrides: Any) -> SystemSpec:
    return SystemSpec(name, description, MappingProxyType(dict(overrides)), kind, remote=remote, cold=cold)


SYSTEMS: Mapping[str, SystemSpec] = MappingProxyType({
    s.name: s
    for s in (
        _spec("no-reuse", "no KV reuse: every prompt token is computed", enable_cache=False),
        _spec("dram-only", "prefix cache in DRAM only, on-demand loads (CCache)", ssd_capacity=0,
              layerwise=False, prefetch=False, eviction="lru"),
        _spec("ssd-on-demand", "DRAM + SSD cache, synchronous loads, no overlap, no prefetch (SCCache/LMCache-like)",
              layerwise=False, prefetch=False, eviction="lru"),
        _spec("pcr", "PCR: DRAM + SSD, layer-wise overlap, queue prefetch, look-ahead LRU"),
        _spec("pcr-no-overlap", "PCR without layer-wise overlap", layerwise=False),
        _spec("pcr-no-prefetch", "PCR without queue prefetch", prefetch=False),
        _spec("pcr-lru", "PCR with plain LRU instead of look-ahead LRU", eviction="lru"),
        _spec("pcr-whole-steps", "PCR without the ITL budget: prefill steps run whole between decode steps",
              itl_budget_steps=None),
        _spec("pcr-always-load", "PCR loading every cached chunk (no load-or-recompute planner)",
              load_planner="always-load"),
        _spec("pcr-blend", "PCR with blend mode: documents after the exact prefix placed from their "
              "position-independent KV (approximate, opt-in)", reuse="blend"),
        _spec("pcr-cold", "PCR as a new replica: empty local tiers before every run", cold=True),
        _spec("pcr-remote", "PCR new replica behind a shared Valkey another replica warmed", cold=True,
              remote="warm"),
        _spec("pcr-remote-down", "PCR new replica whose remote Valkey is down", cold=True, remote="down"),
        _spec("transformers", "plain transformers model.generate, one-shot prefill, no reuse (HuggingFaceLLM)",
              "transformers", enable_cache=False),
        _spec("llama-cpp", "llama-cpp-python on the GGUF weights, one-slot LlamaRAMCache", "llama-cpp",
              enable_cache=False),
    )
})

BASELINE_SYSTEMS: tuple[str, ...] = ("no-reuse", "dram-only", "ssd-on-demand")
ABLATION_SYSTEMS: tuple[str, ...] = ("pcr-no-overlap", "pcr-no-prefetch", "pcr-lru")
#: The `PCREngine` systems (the simulator's table reads these).
DEFAULT_SYSTEMS: tuple[str, ...] = (*BASELINE_SYSTEMS, "pcr", *ABLATION_SYSTEMS)
#: Outside baselines: what a user gets without pcr-rag.
EXTERNAL_SYSTEMS: tuple[str, ...] = ("transformers", "llama-cpp")
#: The admission policies compared on pcr (skipped when the engine has no ``schedule`` option).
SCHEDULE_SYSTEMS: tuple[str, ...] = ("pcr-schedule-fcfs", "pcr-schedule-cache-aware")
#: What ``pcr-rag bench`` compares by default.
BENCH_DEFAULT_SYSTEMS: tuple[str, ...] = (*DEFAULT_SYSTEMS, *EXTERNAL_SYSTEMS, *SCHEDULE_SYSTEMS)

_SCHEDULES = ("fcfs", "cache-aware")


def window_variant(window: int) -> SystemSpec:
    """``pcr-window-N``: pcr with a prefetch look-ahead window of ``window`` waiting requests."""
    if window < 0:
        raise ValueError(f"prefetch window must be >= 0, got {window}")
    return _spec(f"pcr-window-{window}", f"PCR with prefetch window {window}", prefetch_window=window)


def max_active_variant(max_active: int) -> SystemSpec:
    """``pcr-max-active-N``: pcr with at most ``max_active`` requests decoding at once."""
    if max_active < 1:
        raise ValueError(f"max_active must be >= 1, got {max_active}")
    return _spec(f"pcr-max-active-{max_active}", f"PCR with max_active={max_active}", max_active=max_active)


def get_system(name: str) -> SystemSpec:
    """A known system by name, a ``pcr-window-N`` / ``pcr-max-active-N`` / ``pcr-schedule-S`` variant, or a
    cached system with an ``@relevance`` / ``@cache-aware`` order suffix."""
    base_name, at, order = name.partition("@")
    if at:
        if order not in ORDERS:
            raise UnknownSystemError(f"unknown document order {order!r} in {name!r}; use one of {', '.join(ORDERS)}")
        base = get_system(base_name)
        if not base.uses_cache or base.order is not None:
            raise UnknownSystemError(f"{name!r}: a document order applies to a cached pcr-rag system only, "
                                     f"not to {base_name!r}")
        return replace(base, name=name, description=f"{base.description}; {order} document order", order=order)
    if name in SYSTEMS:
        return SYSTEMS[name]
    for prefix, make in (("pcr-window-", window_variant), ("pcr-max-active-", max_active_variant)):
        if name.startswith(prefix) and name.removeprefix(prefix).isdigit():
            try:
                return make(int(name.removeprefix(prefix)))
            except ValueError as exc:
                raise UnknownSystemError(f"{name!r}: {exc}") from None
    if name.startswith("pcr-schedule-") and name.removeprefix("pcr-schedule-") in _SCHEDULES:
        schedule = name.removeprefix("pcr-schedule-")
        return _spec(name, f"PCR with {schedule} admission", schedule=schedule)
    raise UnknownSystemError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}, pcr-window-N, "
                             f"pcr-max-active-N, pcr-schedule-{{{','.join(_SCHEDULES)}}}, or <cached system>@"
                             f"{{{','.join(ORDERS)}}}")


def system_names(names: str | Sequence[str] | None, windows: Iterable[int] = (),
                 default: Sequence[str] = DEFAULT_SYSTEMS) -> list[str]:
    """System names from a comma-separated string or a list (None = ``default``), plus one ``pcr-window-N`` per
    window in ``windows``; duplicates dropped, order kept. Raises `UnknownSystemError` when nothing is left."""
    if names is None:
        items = list(default)
    elif isinstance(names, str):
        items = [n.strip() for n in names.split(",") if n.strip()]
    else:
        items = list(names)
    items += [f"pcr-window-{w}" for w in windows]
    if not items:
        raise UnknownSystemError("no systems selected")
    return list(dict.fromkeys(items))


def parse_systems(names: str | Sequence[str] | None, windows: Iterable[int] = ()) -> list[SystemSpec]:
    """`SystemSpec`s for `system_names` (None = :data:`DEFAULT_SYSTEMS`)."""
    return [get_system(n) for n in system_names(names, windows)]
