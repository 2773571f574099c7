"""langchain-tests standard integration suite for ``ChatPCR(base_url=...)``: the same suite, the same model and the
same expected failures as the local `TestChatPCRIntegration`, through a real `pcr-rag serve` (in-process uvicorn on
loopback) instead of an engine in the test's process."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread

# The local suite's class, loaded from its file (the suite runs with --import-mode=importlib) under a name pytest
# does not collect a second time.
_spec = importlib.util.spec_from_file_location(
    "_langchain_std_local", Path(__file__).with_name("test_langchain_chat_integration_standard.py"))
_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_local)
LocalSuite = _local.TestChatPCRIntegration

pytestmark = pytest.mark.slow

_SERVED: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def served_default_model() -> Iterator[str]:
    """`pcr-rag serve` on the default model for the whole class (one model load)."""
    config = EngineConfig(cache_dir=tempfile.mkdtemp(prefix="pcr-lc-std-remote-"), dram_capacity="256MiB",
                          ssd_capacity="256MiB")
    with PCREngine(config=config) as engine, ServerThread(engine) as url:
        _SERVED["url"] = url
        yield url
    _SERVED.clear()


class TestChatPCRRemoteIntegration(LocalSuite):
    @property
    def chat_model_params(self) -> dict:
        return {"base_url": _SERVED["url"]}
