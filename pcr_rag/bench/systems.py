"""The systems a benchmark compares, as `EngineConfig` field overrides (no engine import: the simulator reuses them).

============== =============================================================================================
no-reuse       plain chunk-aligned prefill, no cache at all (the vLLM-without-prefix-cache analog)
dram-only      prefix cache in DRAM only, on-demand (no SSD tier, no overlap, no prefetch, LRU; paper's CCache)
ssd-on-demand  DRAM + SSD, synchronous loads, no overlap, no prefetch, LRU (paper's SCCache, LMCache-like)
pcr            everything: DRAM + SSD, layer-wise overlap, queue prefetch, look-ahead LRU
pcr-no-overlap pcr with ``layerwise=False``
pcr-no-prefetch pcr with ``prefetch=False`` (look-ahead protection stays)
pcr-lru        pcr with plain LRU eviction (no look-ahead protection)
pcr-window-N   pcr with ``prefetch_window=N`` (the window sweep)
pcr-cold       pcr as a cold replica: empty DRAM and SSD before every measured run, no warm-up (``cold``)
pcr-remote     pcr-cold behind a shared Valkey that a first replica warmed with the warm-up trace
               (``remote="warm"``)
pcr-remote-down pcr-cold with a remote tier whose server is down (``remote="down"``: nothing listens there)
============== =============================================================================================

The last three are not in the default set; they compare a new replica with and without a shared remote tier.

Tier capacities are not part of a system: the runner sets them from the workload's working set, the same for all
(except that ``dram-only`` has no SSD tier).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "ABLATION_SYSTEMS",
    "BASELINE_SYSTEMS",
    "DEFAULT_SYSTEMS",
    "SYSTEMS",
    "SystemSpec",
    "UnknownSystemError",
    "get_system",
    "parse_systems",
    "window_variant",
]


class UnknownSystemError(ValueError):
    """A system name that is neither a known system nor ``pcr-window-N``."""


@dataclass(frozen=True)
class SystemSpec:
    """One compared system: a name, what it is, and the `EngineConfig` fields it sets."""

    name: str
    description: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    remote: str | None = None  # "warm": behind the run's shared store; "down": a remote URL nobody answers
    cold: bool = False  # fresh, empty local tiers before every measured run, no warm-up

    @property
    def uses_cache(self) -> bool:
        return bool(self.overrides.get("enable_cache", True))

    @property
    def uses_ssd(self) -> bool:
        return self.uses_cache and self.overrides.get("ssd_capacity", None) != 0

    def config_kwargs(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``base`` (shared fields: cache_dir, capacities, chunk_size, ...) with this system's overrides on top."""
        kwargs = dict(base or {})
        kwargs.update(self.overrides)
        return kwargs


def _spec(name: str, description: str, *, remote: str | None = None, cold: bool = False,
          **overrides: Any) -> SystemSpec:
    return SystemSpec(name, description, MappingProxyType(dict(overrides)), remote, cold)


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
        _spec("pcr-cold", "PCR as a new replica: empty local tiers before every run", cold=True),
        _spec("pcr-remote", "PCR new replica behind a shared Valkey another replica warmed", cold=True,
              remote="warm"),
        _spec("pcr-remote-down", "PCR new replica whose remote Valkey is down", cold=True, remote="down"),
    )
})

BASELINE_SYSTEMS: tuple[str, ...] = ("no-reuse", "dram-only", "ssd-on-demand")
ABLATION_SYSTEMS: tuple[str, ...] = ("pcr-no-overlap", "pcr-no-prefetch", "pcr-lru")
DEFAULT_SYSTEMS: tuple[str, ...] = (*BASELINE_SYSTEMS, "pcr", *ABLATION_SYSTEMS)


def window_variant(window: int) -> SystemSpec:
    """``pcr-window-N``: pcr with a prefetch look-ahead window of ``window`` waiting requests."""
    if window < 0:
        raise ValueError(f"prefetch window must be >= 0, got {window}")
    return _spec(f"pcr-window-{window}", f"PCR with prefetch window {window}", prefetch_window=window)


def get_system(name: str) -> SystemSpec:
    """A known system by name, or ``pcr-window-N``."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    if name.startswith("pcr-window-"):
        tail = name.removeprefix("pcr-window-")
        if tail.isdigit():
            return window_variant(int(tail))
    raise UnknownSystemError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}, or pcr-window-N")


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
