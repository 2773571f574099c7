"""Fixtures for the langchain-pcr tests: a PCR engine on a tiny random Llama (milliseconds per token) and a corpus."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model

# Short, distinct passages: the tiny tokenizer is byte-level (about one token per 2-3 characters).
PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq": "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest item first.",
    "bisect": "bisect keeps a sorted list sorted. bisect_left finds the insertion point for a value.",
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def make_engine(tiny, tmp_path, **overrides) -> PCREngine:
    model, tokenizer = tiny
    cfg = dict(cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=6,
               dram_capacity="64MiB", ssd_capacity="64MiB", announce_ttl_s=60.0)
    cfg.update(overrides)
    return PCREngine(model, tokenizer, config=EngineConfig(**cfg))


@pytest.fixture
def engine(tiny, tmp_path) -> Iterator[PCREngine]:
    eng = make_engine(tiny, tmp_path)
    yield eng
    eng.close()
