"""The presets and the CLI's run options: --quick (indicative only), --standard (sized to resolve a 10%
difference), --retrieval's order comparison, --order, --saturation."""

from __future__ import annotations

import argparse

import pytest

from pcr_rag.bench import cli as bench_cli
from pcr_rag.bench.config import (
    QUICK_CAVEAT,
    RETRIEVAL_PASSAGES,
    STANDARD_RETRIEVAL_SYSTEMS,
    STANDARD_SYSTEMS,
    BenchConfig,
    BenchError,
    quick_config,
    standard_config,
)
from pcr_rag.bench.targets import RETRIEVAL_TARGETS, SERVING_TARGETS
from pcr_rag.cli import main


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_standard_preset_config():
    cfg = standard_config()
    cfg.validate()
    assert cfg.standard and not cfg.quick
    assert cfg.num_requests * cfg.repeats >= 80 and cfg.repeats >= 4  # paired requests per system (sizing)
    assert len(cfg.loads) == 1 and cfg.windows == () and not cfg.limit_ratio
    assert cfg.systems == STANDARD_SYSTEMS and len(cfg.systems) < len(quick_config().systems)
    assert cfg.saturation == (1, 8) and cfg.order == "relevance"
    # every serving target's systems are in the preset (the schedule pair skips itself on an engine without it)
    for t in SERVING_TARGETS:
        if t.baseline not in ("dram-only", "ssd-on-demand"):
            assert {t.system, t.baseline} <= set(cfg.systems), t.name
    ret = standard_config(retrieval=True)
    ret.validate()
    assert ret.retrieval and ret.order == "cache-aware" and ret.saturation == ()
    assert ret.systems == STANDARD_RETRIEVAL_SYSTEMS and "pcr@relevance" in ret.systems
    assert ret.num_passages == RETRIEVAL_PASSAGES
    for t in RETRIEVAL_TARGETS:  # X@cache-aware is X in a cache-aware run
        for name in (t.system, t.baseline):
            assert name in ret.systems or name.removesuffix("@cache-aware") in ret.systems, name


def test_cli_presets_and_options():
    std = bench_cli.config_from_args(_parse(["--standard"]))
    assert std == standard_config()
    std_r = bench_cli.config_from_args(_parse(["--standard", "--retrieval"]))
    assert std_r.order == "cache-aware" and std_r.systems[-1] == "pcr@relevance"
    quick_r = bench_cli.config_from_args(_parse(["--quick", "--retrieval", "--order", "relevance"]))
    assert quick_r.order == "relevance" and quick_r.systems[-1] == "pcr@cache-aware"  # the other order joins
    assert quick_r.num_passages == RETRIEVAL_PASSAGES
    own = bench_cli.config_from_args(_parse(["--quick", "--retrieval", "--systems", "pcr", "--passages", "50"]))
    assert own.systems == ("pcr",) and own.num_passages == 50
    sat = bench_cli.config_from_args(_parse(["--quick", "--saturation", "", "--num-questions", "160"]))
    assert sat.saturation == () and sat.num_questions == 160
    with pytest.raises(BenchError):
        bench_cli.config_from_args(_parse(["--quick", "--standard"]))
    with pytest.raises(BenchError):
        BenchConfig(order="random").validate()
    with pytest.raises(BenchError):
        BenchConfig(saturation=(0,)).validate()


def test_bad_preset_combination_exits_2(capsys):
    assert main(["bench", "--quick", "--standard"]) == 2
    assert "choose one preset" in capsys.readouterr().err


def test_quick_says_its_ratios_are_indicative():
    cfg = quick_config()
    assert cfg.quick and "indicative only" in QUICK_CAVEAT
