"""A real LangChain RAG pipeline: Chroma (in-process) + local MiniLM embeddings + ChatPCR, cache on vs off."""

from __future__ import annotations

import tempfile
import uuid

import pytest
from langchain_chroma import Chroma
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, MiniLMEmbeddings, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.rag.embeddings import chroma_client

PASSAGES = [
    "pathlib offers classes for filesystem paths. Path objects join parts with the slash operator, and "
    "Path.read_text returns the contents of a file as a string.",
    "json encodes Python objects as JSON text. json.dumps returns a str, json.loads parses one back into "
    "dicts, lists, strings and numbers.",
    "heapq implements a binary min-heap on a plain list. heappush adds an item and heappop removes the "
    "smallest one, both in logarithmic time.",
    "bisect keeps a sorted list sorted. bisect_left returns the insertion point for a value, insort inserts it.",
]
QUESTIONS = ["How do I join paths with pathlib?", "How does pathlib read a file?"]  # same leading document

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
)


def build_chain(llm):
    store = Chroma(collection_name=f"t{uuid.uuid4().hex[:12]}", embedding_function=MiniLMEmbeddings(),
                   client=chroma_client(), collection_metadata={"hnsw:space": "cosine"})
    store.add_texts(PASSAGES)
    retriever = store.as_retriever(search_kwargs={"k": 2})
    context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
    return {"context": context, "question": RunnablePassthrough()} | PROMPT | llm


def run_pipeline(engine) -> list:
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    chain = build_chain(llm)
    return [chain.invoke(q, config={"callbacks": [hook]}) for q in QUESTIONS]


def check_reuse_and_fidelity(cached_engine, uncached_engine) -> None:
    cached = run_pipeline(cached_engine)
    uncached = run_pipeline(uncached_engine)
    first, second = (m.response_metadata for m in cached)
    assert first["documents_found"] == 2 and second["documents_found"] == 2
    # the second question retrieves the same leading document: its chunks come from the cache
    assert second["reused_tokens"] > first["reused_tokens"]
    assert cached_engine.stats().requests["reused_tokens"] >= second["reused_tokens"] > 0  # visible in engine stats
    assert all(m.response_metadata["reused_tokens"] == 0 for m in uncached)
    assert [m.content for m in cached] == [m.content for m in uncached]  # reuse never changes the answer


def test_chroma_pipeline_reuses_kv_and_matches_cache_off_tiny(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    base = dict(chunk_size=16, max_new_tokens=8)
    with PCREngine(model, tokenizer, config=EngineConfig(cache_dir=tmp_path / "on", **base)) as on, \
            PCREngine(model, tokenizer, config=EngineConfig(cache_dir=tmp_path / "off", enable_cache=False,
                                                             **base)) as off:
        check_reuse_and_fidelity(on, off)


@pytest.mark.slow
def test_chroma_pipeline_reuses_kv_and_matches_cache_off_default_model() -> None:
    base = dict(chunk_size=32, max_new_tokens=12, dram_capacity="256MiB", ssd_capacity="256MiB")
    with PCREngine(config=EngineConfig(cache_dir=tempfile.mkdtemp(), **base)) as on, \
            PCREngine(config=EngineConfig(cache_dir=tempfile.mkdtemp(), enable_cache=False, **base)) as off:
        check_reuse_and_fidelity(on, off)
