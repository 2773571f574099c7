"""Fixtures for the server tests: a tiny random Llama served in-process on a free loopback port, a reference engine
(same weights, its own cache) for identical-answer checks, and bounded waits."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerSettings, ServerThread
from pcr_rag.testing import tiny_model

DOCS = (
    "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest first.",
)
QUESTION = "What do pathlib and json do?"


def rag_messages(docs=DOCS, question: str = QUESTION) -> list[dict[str, str]]:
    context = "\n\n".join(docs)
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


def engine_config(tmp_path, **overrides) -> EngineConfig:
    cfg = dict(cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=8,
               dram_capacity="64MiB", ssd_capacity="64MiB", max_active=4, max_model_len=1024, dtype="float32",
               announce_ttl_s=60.0)
    cfg.update(overrides)
    return EngineConfig(**cfg)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory) -> Iterator[PCREngine]:
    model, tokenizer = tiny
    eng = PCREngine(model, tokenizer, config=engine_config(tmp_path_factory.mktemp("served")))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> Iterator[PCREngine]:
    """The same model in an engine of its own: what a local user would get."""
    model, tokenizer = tiny
    eng = PCREngine(model, tokenizer, config=engine_config(tmp_path_factory.mktemp("reference")))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ServerThread]:
    srv = ServerThread(engine, ServerSettings(port=0, max_body_bytes=64 * 1024))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.base_url


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``condition`` until true or ``timeout`` seconds passed (bounded); returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def idle(engine: PCREngine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.queue_depth == 0 and s.cache.pinned_chunks == 0


@pytest.fixture
def fresh(tiny, tmp_path, h) -> Iterator[Callable[..., tuple[PCREngine, str]]]:
    """make(**EngineConfig overrides) -> (server engine, base URL), each on a fresh cache; stopped at the end."""
    started: list[ServerThread] = []

    def make(**overrides) -> tuple[PCREngine, str]:
        model, tokenizer = tiny
        engine = PCREngine(model, tokenizer, config=h.engine_config(tmp_path / uuid.uuid4().hex[:8], **overrides))
        srv = ServerThread(engine, ServerSettings(port=0), owns_engine=True)
        srv.start()
        started.append(srv)
        return engine, srv.base_url

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """Shared helpers (test modules cannot import conftest): DOCS, QUESTION, rag_messages, engine_config,
    wait_until, idle."""
    return SimpleNamespace(DOCS=DOCS, QUESTION=QUESTION, rag_messages=rag_messages, engine_config=engine_config,
                           wait_until=wait_until, idle=idle)
