"""The compared systems map to the right EngineConfig fields."""

from __future__ import annotations

import pytest

from pcr_rag.bench.systems import (
    BENCH_DEFAULT_SYSTEMS,
    DEFAULT_SYSTEMS,
    EXTERNAL_SYSTEMS,
    SCHEDULE_SYSTEMS,
    SYSTEMS,
    UnknownSystemError,
    get_system,
    parse_systems,
    window_variant,
)
from pcr_rag.config import EngineConfig


def test_every_system_builds_a_valid_engine_config(tmp_path):
    base = {"cache_dir": tmp_path, "dram_capacity": 1 << 20, "ssd_capacity": 1 << 22}
    for name in DEFAULT_SYSTEMS:
        cfg = EngineConfig(**get_system(name).config_kwargs(base))
        assert cfg.dram_capacity == 1 << 20
    assert EngineConfig(**SYSTEMS["no-reuse"].config_kwargs(base)).enable_cache is False
    dram = EngineConfig(**SYSTEMS["dram-only"].config_kwargs(base))
    assert dram.ssd_capacity == 0 and not dram.layerwise and not dram.prefetch
    sod = EngineConfig(**SYSTEMS["ssd-on-demand"].config_kwargs(base))
    assert sod.ssd_capacity == 1 << 22 and not sod.layerwise and not sod.prefetch and sod.eviction == "lru"
    pcr = EngineConfig(**SYSTEMS["pcr"].config_kwargs(base))
    assert pcr.layerwise and pcr.prefetch and pcr.eviction == "lookahead-lru" and pcr.enable_cache
    assert not EngineConfig(**SYSTEMS["pcr-no-overlap"].config_kwargs(base)).layerwise
    assert not EngineConfig(**SYSTEMS["pcr-no-prefetch"].config_kwargs(base)).prefetch
    assert EngineConfig(**SYSTEMS["pcr-lru"].config_kwargs(base)).eviction == "lru"
    assert EngineConfig(**window_variant(3).config_kwargs(base)).prefetch_window == 3


def test_system_flags():
    assert not SYSTEMS["no-reuse"].uses_cache and not SYSTEMS["no-reuse"].uses_ssd
    assert SYSTEMS["dram-only"].uses_cache and not SYSTEMS["dram-only"].uses_ssd
    assert SYSTEMS["pcr"].uses_ssd


def test_parse_systems():
    assert [s.name for s in parse_systems(None)] == list(DEFAULT_SYSTEMS)
    assert [s.name for s in parse_systems("pcr, no-reuse,pcr")] == ["pcr", "no-reuse"]
    assert [s.name for s in parse_systems(["pcr"], windows=[2, 10])] == ["pcr", "pcr-window-2", "pcr-window-10"]
    assert get_system("pcr-window-4").overrides["prefetch_window"] == 4
    with pytest.raises(UnknownSystemError, match="known"):
        parse_systems("vllm")
    with pytest.raises(UnknownSystemError):
        get_system("pcr-window-x")
    with pytest.raises(UnknownSystemError):
        parse_systems("")


def test_outside_baselines_and_variants(tmp_path):
    trans, llama = get_system("transformers"), get_system("llama-cpp")
    assert trans.kind == "transformers" and llama.kind == "llama-cpp"
    assert not trans.uses_cache and not llama.uses_cache  # no pcr-rag cache: the document order never applies
    assert set(EXTERNAL_SYSTEMS) == {"transformers", "llama-cpp"}
    assert set(BENCH_DEFAULT_SYSTEMS) >= {*DEFAULT_SYSTEMS, *EXTERNAL_SYSTEMS, *SCHEDULE_SYSTEMS}
    assert get_system("pcr-max-active-1").overrides["max_active"] == 1
    assert get_system("pcr-schedule-cache-aware").overrides["schedule"] == "cache-aware"
    twin = get_system("pcr@relevance")
    assert twin.order == "relevance" and dict(twin.overrides) == dict(SYSTEMS["pcr"].overrides)
    assert get_system("ssd-on-demand@cache-aware").order == "cache-aware"
    base = {"cache_dir": tmp_path, "dram_capacity": 1 << 20, "ssd_capacity": 1 << 22}
    assert EngineConfig(**get_system("pcr-max-active-1").config_kwargs(base)).max_active == 1
    for bad in ("no-reuse@cache-aware", "transformers@relevance", "pcr@sideways", "pcr@relevance@cache-aware",
                "pcr-schedule-lifo", "pcr-max-active-0"):
        with pytest.raises(UnknownSystemError):
            get_system(bad)
