"""LangChain against a real `pcr-rag serve` (in-process uvicorn on loopback): `ChatOpenAI(base_url=...)` runs a RAG
chain, and `ChatPCR(base_url=...)` / `PCRLLM(base_url=...)` behave as with a local engine, their retrieval hook
announcing to the server before the model call."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI
from langchain_pcr import PCRLLM, ChatPCR, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq": "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest first.",
}
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
)


class KeywordRetriever(BaseRetriever):
    passages: dict[str, str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for k, t in self.passages.items() if k in query.lower()]


def config(tmp_path, name: str) -> EngineConfig:
    return EngineConfig(cache_dir=tmp_path / f"{name}-{uuid.uuid4().hex[:6]}", chunk_size=16, max_new_tokens=6,
                        dram_capacity="64MiB", ssd_capacity="64MiB", max_active=4, max_model_len=1024,
                        dtype="float32", announce_ttl_s=60.0)


@pytest.fixture
def served(tiny, tmp_path):
    """(server engine, base URL, reference engine with the same weights)."""
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=config(tmp_path, "served")) as engine, \
            PCREngine(model, tokenizer, config=config(tmp_path, "reference")) as reference, \
            ServerThread(engine) as url:
        yield engine, url, reference


def rag_chain(llm, probe=None):
    retriever = KeywordRetriever(passages=PASSAGES)
    chain = {"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
             "question": RunnablePassthrough()} | PROMPT
    if probe is not None:
        chain = chain | RunnableLambda(probe)
    return chain | llm


def test_chat_openai_runs_a_rag_chain_and_reuses_the_documents(served) -> None:
    engine, url, reference = served
    llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=engine.loaded.name, max_tokens=6,
                     temperature=0, max_retries=0)
    retriever = KeywordRetriever(passages=PASSAGES)

    def answer(inputs):  # documents go in the `documents` extension, so each is cached as its own run
        docs = [d.page_content for d in inputs["docs"]]
        messages = PROMPT.format_messages(context="\n\n".join(docs), question=inputs["question"])
        return llm.invoke(messages, extra_body={"documents": docs})

    chain = {"docs": retriever, "question": RunnablePassthrough()} | RunnableLambda(answer)
    first = chain.invoke("what do pathlib and json do?")
    second = chain.invoke("pathlib or json: which one parses?")
    local = rag_chain(ChatPCR(engine=reference)).invoke("what do pathlib and json do?",
                                                        config={"callbacks": [PCRRetrievalCallback(reference)]})
    assert first.content == local.content
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0  # same documents, other question
    plain = rag_chain(llm).invoke("what is heapq?")  # no documents: still an ordinary OpenAI endpoint
    assert isinstance(plain.content, str) and plain.usage_metadata["input_tokens"] > 0


def test_chat_pcr_base_url_announces_before_the_call_and_matches_local(served) -> None:
    engine, url, reference = served
    remote = ChatPCR(base_url=url, max_tokens=6)
    hook = PCRRetrievalCallback(remote)
    seen = {}

    def probe(value):  # after retrieval, before the model: the server already holds the announcement
        seen["pending"] = engine.stats().prefetch["pending_announcements"]
        seen["window"] = engine.window_snapshot()
        return value

    msg = rag_chain(remote, probe).invoke("what do pathlib and json do?", config={"callbacks": [hook]})
    assert seen["pending"] == 1 and len(seen["window"]) == 1 and len(seen["window"][0]) > 0
    meta = msg.response_metadata
    assert meta["documents_announced"] and meta["announcement_claimed"] and meta["documents_found"] == 2
    assert engine.stats().prefetch["claimed"] == 1 and engine.stats().prefetch["pending_announcements"] == 0
    local_llm = ChatPCR(engine=reference, max_tokens=6)
    local = rag_chain(local_llm).invoke("what do pathlib and json do?",
                                        config={"callbacks": [PCRRetrievalCallback(local_llm)]})
    assert msg.content == local.content
    assert msg.usage_metadata["input_tokens"] == local.usage_metadata["input_tokens"]
    again = rag_chain(remote).invoke("what do pathlib and json do?", config={"callbacks": [hook]})
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    streamed = "".join(c.content for c in rag_chain(remote).stream("what do pathlib and json do?",
                                                                   config={"callbacks": [hook]}))
    assert streamed == "".join(c.content for c in rag_chain(local_llm).stream("what do pathlib and json do?"))
    assert asyncio.run(rag_chain(remote).ainvoke("what do pathlib and json do?")).content == msg.content
    assert remote.model_name == engine.loaded.name


def test_pcr_llm_base_url(served) -> None:
    engine, url, reference = served
    prompt = "Context: " + PASSAGES["heapq"] + "\nQuestion: what is heapq?"
    remote = PCRLLM(base_url=url, max_tokens=6)
    local = PCRLLM(engine=reference, max_tokens=6)
    assert remote.invoke(prompt, documents=[PASSAGES["heapq"]]) == local.invoke(prompt, documents=[PASSAGES["heapq"]])
    result = remote.generate([prompt, prompt])
    assert result.llm_output["token_usage"]["cached_tokens"] > 0
    assert "".join(remote.stream(prompt)) == "".join(local.stream(prompt))
    with pytest.raises(ValueError, match="base_url"):
        PCRLLM(base_url=url, engine=reference)


def test_token_counts_over_base_url_are_the_servers(served, monkeypatch) -> None:
    """ChatPCR / PCRLLM with base_url count tokens with the server's tokenizer (/tokenize), not GPT-2."""
    import warnings

    from langchain_core.language_models import base as lc_base

    def fallback(text: str) -> list[int]:
        raise AssertionError("LangChain's GPT-2 fallback tokenizer was used")

    monkeypatch.setattr(lc_base, "_get_token_ids_default_method", fallback)
    _, url, reference = served
    text = "functools.lru_cache memoizes a function, héllo wörld"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for llm in (ChatPCR(base_url=url), PCRLLM(base_url=url)):
            assert llm.get_token_ids(text) == reference.tokenizer(text, add_special_tokens=False)["input_ids"]
            assert llm.get_num_tokens(text) == reference.count_tokens(text) > 7
