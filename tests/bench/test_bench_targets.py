"""The benchmark targets live in one place: the reports, the limit ratio and the README read them from there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pcr_rag.bench.limit import LimitRatioResult
from pcr_rag.bench.targets import (
    LIMIT_RATIO_DRAM_MAX,
    LIMIT_RATIO_SSD_MAX,
    LIMIT_RATIO_TARGETS,
    PAPER_MIN_SPEEDUP_VS_NO_REUSE,
    PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND,
    PAPER_TARGETS,
    RETRIEVAL_TARGETS,
    SERVING_TARGETS,
)

REPO = Path(__file__).resolve().parents[2]


def test_target_names_carry_their_thresholds():
    for t in (*SERVING_TARGETS, *RETRIEVAL_TARGETS):
        threshold = t.min_ratio if t.min_ratio is not None else t.max_ratio
        assert f"{threshold:g}x" in t.name and t.system in t.name and t.baseline in t.name, t.name
        assert t.system.startswith("pcr")
    assert any(t.baseline == "transformers" for t in SERVING_TARGETS)
    assert {t.baseline for t in RETRIEVAL_TARGETS} >= {"pcr@relevance", "no-reuse"}
    vs_sod, vs_nr = PAPER_TARGETS
    assert vs_sod.max_ratio == pytest.approx(1 - PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND)
    assert vs_nr.max_ratio == pytest.approx(1 / PAPER_MIN_SPEEDUP_VS_NO_REUSE)
    assert f"{PAPER_MIN_TTFT_REDUCTION_VS_SSD_ON_DEMAND:.0%}" in vs_sod.name
    assert set(LIMIT_RATIO_TARGETS) == {"ratio_dram", "ratio_ssd"}


def test_the_benchmarks_page_quotes_every_target():
    """docs/benchmarks.md lists every target a report judges, by the name the report prints (the README links it)."""
    page = " ".join((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").split())
    for t in (*SERVING_TARGETS, *RETRIEVAL_TARGETS, *PAPER_TARGETS):
        assert f"`{t.name}`" in page, t.name
    assert f"DRAM `<= {LIMIT_RATIO_DRAM_MAX:.2f}`" in page and f"SSD `<= {LIMIT_RATIO_SSD_MAX:.2f}`" in page


def test_limit_ratio_is_judged_by_the_targets():
    res = LimitRatioResult(
        prefix_tokens=512, suffix_tokens=20, raw_forward_s=0.1, ttft_dram_s=0.11, ttft_ssd_s=0.13,
        ttft_dram_no_overlap_s=0.12, ttft_ssd_no_overlap_s=0.15, ratio_dram=LIMIT_RATIO_DRAM_MAX,
        ratio_ssd=LIMIT_RATIO_SSD_MAX + 0.01, ratio_dram_no_overlap=1.2, ratio_ssd_no_overlap=1.5,
        ttft_uncached_s=1.0, reps=3)
    assert res.passed() == {"ratio_dram": True, "ratio_ssd": False}
    summary = res.summary()
    assert f"target <= {LIMIT_RATIO_DRAM_MAX:.2f}" in summary and f"target <= {LIMIT_RATIO_SSD_MAX:.2f}" in summary


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (function-local imports included)."""
    files = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return False


def test_bench_and_sim_have_no_import_cycles():
    graph = _import_graph(REPO / "pcr_rag")
    ours = [m for m in graph if m.startswith(("pcr_rag.bench", "pcr_rag.sim"))]
    assert len(ours) > 10
    cycles = [m for m in ours if _reaches(graph, m, m)]
    assert not cycles, f"modules on an import cycle: {cycles}"
