"""The docs site builds strictly, its generated pages hold what they promise, and the README's picture is drawn
from a bench report.

- ``mkdocs build --strict``: a broken link or anchor, a page missing from the nav, a mkdocstrings object that no
  longer exists, or an `EngineConfig` field without a docstring entry fails the build, so it fails here.
- The Configuration reference is generated from the dataclasses at build time (``docs/hooks``): every field of
  `EngineConfig` and `ServerSettings` is on it, with its serve flag.
- ``scripts/plot_ttft.py`` draws the bars from a report's per-request TTFTs (saturation runs left out) and refuses a
  report without the cache-on system.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pcr_rag.bench.report import SCHEMA
from pcr_rag.config import EngineConfig
from pcr_rag.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_mkdocs_build_strict(tmp_path: Path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    config_page = (site / "configuration.html").read_text(encoding="utf-8")
    for f in dataclasses.fields(EngineConfig):
        assert f"<code>{f.name}</code>" in config_page, f"EngineConfig.{f.name} missing from the built reference"
    assert "--remote-secret-file" in config_page
    assert 'class="mermaid"' in (site / "how-it-works.html").read_text(encoding="utf-8")
    api = (site / "api.html").read_text(encoding="utf-8")
    for name in ("PCREngine", "EngineConfig", "SamplingParams", "Doc", "ChatPCR", "PCRRetrievalCallback"):
        assert name in api, f"{name} missing from the API reference"
    assert (site / "assets" / "ttft.png").is_file()


def test_config_reference_lists_every_field_with_its_flag():
    hook = _load(ROOT / "docs" / "hooks" / "config_reference.py", "pcr_docs_config_reference")
    page = hook.render()
    for cls in (EngineConfig, ServerSettings):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            rows = [line for line in page.splitlines() if line.startswith(f"| **`{f.name}`**<br>")]
            assert rows, f"{cls.__name__}.{f.name} has no row in the Configuration reference"
            flag = f"--{f.name.replace('_', '-')}"
            assert any(flag in row for row in rows), f"{cls.__name__}.{f.name}: no {flag} in {rows}"
    secret = next(line for line in page.splitlines() if line.startswith("| **`remote_secret`**<br>"))
    assert "--remote-secret-file PATH" in secret  # a secret is read from a file, never given as a value


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(encoding="utf-8"), re.M | re.S)


def test_integration_pages_show_the_readmes_tested_snippets():
    """The LlamaIndex and LangChain pages open with the README's snippets (which tests/test_readme.py runs), word
    for word, so the site never shows an untested copy."""
    readme = _python_blocks(ROOT / "README.md")
    for page, marker in (("llamaindex.md", "SimpleDirectoryReader"), ("langchain.md", "ChatPCR")):
        ours = next(b for b in readme if marker in b)
        assert _python_blocks(ROOT / "docs" / page)[0] == ours, f"docs/{page}'s first block differs from the README's"


def _run(system: str, rate: float | str, ttfts: list[float]) -> dict:
    return {"system": system, "rate": rate, "num_requests": len(ttfts),
            "ttft": {"mean": sum(ttfts) / len(ttfts)}, "requests": {"ttft": ttfts}}


def _report(systems: dict[str, float]) -> dict:
    runs = []
    for rate in (0.3, 0.45):
        for system, base in systems.items():
            runs.append(_run(system, rate, [base * (1 + 0.1 * k) * (1 + rate) for k in range(12)]))
    runs.append(_run("pcr", "inf", [9.0] * 12))  # a saturation run: never drawn
    return {"schema": SCHEMA, "kind": "bench", "created_utc": "2026-12-05T08:00:00Z", "runs": runs,
            "config": {"model_name": "/models/smollm2-135m-instruct-abc"},
            "environment": {"cpus": 2, "device": "cpu", "dtype": "bfloat16"}, "aliases": {}}


def test_plot_ttft_draws_the_reports_runs(tmp_path: Path):
    plot = _load(ROOT / "scripts" / "plot_ttft.py", "pcr_plot_ttft")
    report = _report({"transformers": 1.0, "no-reuse": 0.8, "pcr": 0.2})
    rates, bars = plot.collect(report, plot.DEFAULT_SYSTEMS)
    assert rates == [0.3, 0.45]  # the all-at-once run is left out
    assert {s for s, _ in bars} == {"transformers", "no-reuse", "pcr"}  # llama-cpp absent from the report
    bar = bars[("pcr", 0.3)]
    expected = sum(0.2 * (1 + 0.1 * k) * 1.3 for k in range(12)) / 12
    assert bar.mean_s == pytest.approx(expected) and bar.n == 12
    assert bar.low_s is not None and bar.low_s < bar.mean_s < bar.high_s

    path = tmp_path / "report.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    out = tmp_path / "ttft.png"
    assert plot.main([str(path), "--out", str(out), "--host", "test host"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_ttft_refuses_a_report_without_the_cache_on_system(tmp_path: Path):
    plot = _load(ROOT / "scripts" / "plot_ttft.py", "pcr_plot_ttft")
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report({"transformers": 1.0, "no-reuse": 0.8})), encoding="utf-8")
    out = tmp_path / "ttft.png"
    assert plot.main([str(path), "--out", str(out)]) == 2
    assert not out.exists()
