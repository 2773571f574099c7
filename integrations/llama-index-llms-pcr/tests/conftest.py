"""Fixtures for the llama-index-llms-pcr tests: a PCR engine on a tiny random Llama, and a Chroma-backed index."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.llms.pcr import MiniLMEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.rag.embeddings import chroma_client, chroma_embedding_function
from pcr_rag.testing import tiny_model

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join parts with the slash operator, and "
               "Path.read_text returns the contents of a file as a string.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str, json.loads parses one back.",
    "heapq": "heapq implements a binary min-heap on a plain list. heappush adds an item, heappop removes the "
             "smallest one.",
    "bisect": "bisect keeps a sorted list sorted. bisect_left returns the insertion point for a value.",
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def make_engine(tiny, tmp_path, **overrides) -> PCREngine:
    model, tokenizer = tiny
    cfg = dict(cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=6,
               dram_capacity="64MiB", ssd_capacity="64MiB")
    cfg.update(overrides)
    return PCREngine(model, tokenizer, config=EngineConfig(**cfg))


@pytest.fixture
def engine(tiny, tmp_path) -> Iterator[PCREngine]:
    eng = make_engine(tiny, tmp_path)
    yield eng
    eng.close()


def build_index(passages: dict[str, str] | None = None) -> VectorStoreIndex:
    """An in-process Chroma collection embedded with the packaged MiniLM (no download), wrapped in an index."""
    collection = chroma_client().create_collection(
        f"t{uuid.uuid4().hex[:12]}", embedding_function=chroma_embedding_function(),
        configuration={"hnsw": {"space": "cosine"}},
    )
    docs = [Document(text=text, metadata={"module": key}) for key, text in (passages or PASSAGES).items()]
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    return VectorStoreIndex.from_documents(docs, storage_context=storage, embed_model=MiniLMEmbedding())


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    return build_index()


@pytest.fixture
def engine_factory(tiny, tmp_path):
    """make(**EngineConfig overrides) -> a new engine on the tiny model (closed by the caller)."""
    return lambda **overrides: make_engine(tiny, tmp_path, **overrides)


@pytest.fixture(scope="module")
def index_factory():
    """make(passages) -> a new Chroma-backed index."""
    return build_index
