"""Schemathesis fuzzes a live server (the tiny model) from its own /openapi.json: no 5xx, every status, content type
and response body as the schema documents them, and bodies that break the schema rejected with 4xx.

Bounded and reproducible: a fixed seed, no example database, a fixed number of examples per operation and a time
budget (the CLI stops when it is spent). A failure prints schemathesis' report with a curl line to replay it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pcr_rag import PCREngine
from pcr_rag.server import ServerSettings, ServerThread

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection")
SEED = 20261205
MAX_EXAMPLES = 20
BUDGET_S = 60


@pytest.fixture(scope="module")
def fuzzed(tiny, tmp_path_factory, h):
    model, tokenizer = tiny
    # a short max_model_len keeps every accepted request short (fuzzed max_tokens beyond it get 400)
    config = h.engine_config(tmp_path_factory.mktemp("fuzz"), max_model_len=160, max_new_tokens=4)
    engine = PCREngine(model, tokenizer, config=config)
    srv = ServerThread(engine, ServerSettings(port=0, max_body_bytes=256 * 1024), owns_engine=True)
    with srv:
        yield srv


def test_schemathesis_finds_no_server_error_nor_schema_violation(fuzzed, h) -> None:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", fuzzed.base_url + "/openapi.json",
           "--checks", ",".join(CHECKS), "--phases", "examples,coverage,fuzzing",
           "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--generation-database", "none",
           "--max-time", str(BUDGET_S), "--workers", "1", "--request-timeout", "30", "--no-color",
           "--warnings", "off"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET_S + 120, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "generated" in output  # it ran cases, not just loaded the schema
    assert h.wait_until(lambda: h.idle(fuzzed.state.engine))
