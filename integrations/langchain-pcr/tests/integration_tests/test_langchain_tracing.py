"""A LangChain RAG chain traced by OpenInference's instrumentor (OpenTelemetry) shows the retriever, the announcement
it made, and the chat model's call with the engine's request under it, in one trace (`pcr_rag.tracing`); with
``base_url=`` the server's request spans join that trace under the retriever (announce) and the model (chat call)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine, tracing
from pcr_rag.server import ServerThread

pytest.importorskip("openinference.instrumentation.langchain")

from openinference.instrumentation.langchain import LangChainInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

KIND = "openinference.span.kind"
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")])


class FixedRetriever(BaseRetriever):
    """Returns the same passages for every query (the tracing, not the retrieval, is under test)."""

    passages: list[str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=p) for p in self.passages]


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    tracing.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_tracer_provider(None)
        instrumentor.uninstrument()


def ancestors(span: ReadableSpan, spans: list[ReadableSpan]) -> list[ReadableSpan]:
    by_id = {s.context.span_id: s for s in spans}
    out = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        out.append(span)
    return out


def test_chain_trace_shows_retrieval_announce_llm_and_prefill(engine, exporter) -> None:
    llm = ChatPCR(engine=engine, max_tokens=3)
    retriever = FixedRetriever(passages=["pathlib joins paths with the slash operator.",
                                         "json.dumps returns a str and json.loads parses one."])
    context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
    chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm
    answer = chain.invoke("How do paths join?", config={"callbacks": [PCRRetrievalCallback(llm)]})
    assert answer.response_metadata["announcement_claimed"] is True
    request_name = f"chat {engine.loaded.name}"
    deadline = time.monotonic() + 10
    while not any(s.name == request_name for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = list(exporter.get_finished_spans())
    assert len({s.context.trace_id for s in spans}) == 1, "one trace for the whole chain"

    (announce,) = [s for s in spans if s.name == "pcr_rag.announce"]
    assert "RETRIEVER" in [a.attributes.get(KIND) for a in ancestors(announce, spans)]
    (request,) = [s for s in spans if s.name == request_name]
    above = [a.attributes.get(KIND) for a in ancestors(request, spans)]
    assert above[0] == "LLM" and "RETRIEVER" not in above
    assert [link.context.span_id for link in request.links] == [announce.context.span_id]
    (prefill,) = [s for s in spans if s.name == "pcr_rag.prefill"]
    assert prefill.parent.span_id == request.context.span_id


@pytest.fixture(scope="module")
def base_url(tiny, tmp_path_factory) -> Iterator[str]:
    """A `pcr-rag serve` app on the tiny model (in-process, loopback); its spans go to the test's provider."""
    model, tokenizer = tiny
    cfg = EngineConfig(cache_dir=tmp_path_factory.mktemp(f"served-{uuid.uuid4().hex[:6]}"), chunk_size=16,
                       max_new_tokens=6, dram_capacity="64MiB", ssd_capacity="64MiB", max_model_len=1024,
                       dtype="float32", announce_ttl_s=60.0)
    with PCREngine(model, tokenizer, config=cfg) as engine, ServerThread(engine) as url:
        yield url


def run_chain(chain, question: str, config: dict, mode: str) -> None:
    """One chain call the way ``mode`` names it (each reaches `ChatPCR` through another entry point)."""
    if mode == "invoke":
        chain.invoke(question, config=config)
    elif mode == "ainvoke":
        asyncio.run(chain.ainvoke(question, config=config))
    elif mode == "stream":
        assert list(chain.stream(question, config=config))
    else:
        async def drain() -> list:
            return [chunk async for chunk in chain.astream(question, config=config)]
        assert asyncio.run(drain())


@pytest.mark.parametrize("mode", ["invoke", "ainvoke", "stream", "astream"])
def test_remote_model_call_carries_the_models_span_to_the_server(base_url, exporter, mode) -> None:
    llm = ChatPCR(base_url=base_url, max_tokens=3)
    retriever = FixedRetriever(passages=["pathlib joins paths with the slash operator.",
                                         "json.dumps returns a str and json.loads parses one."])
    context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
    chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm
    run_chain(chain, "How do paths join?", {"callbacks": [PCRRetrievalCallback(llm)]}, mode)
    names = ("POST /v1/pcr/announce", "POST /v1/chat/completions")
    deadline = time.monotonic() + 10
    while (not all(any(s.name == n for s in exporter.get_finished_spans()) for n in names)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    spans = list(exporter.get_finished_spans())
    (model,) = [s for s in spans if s.attributes.get(KIND) == "LLM"]
    (chat,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert chat.context.trace_id == model.context.trace_id, "the server's chat span joins the chain's trace"
    assert model.context.span_id in [a.context.span_id for a in ancestors(chat, spans)]
    (announce,) = [s for s in spans if s.name == "POST /v1/pcr/announce"]
    above = [a.attributes.get(KIND) for a in ancestors(announce, spans)]
    assert "RETRIEVER" in above and "LLM" not in above


def test_local_stream_request_is_under_the_models_span(engine, exporter) -> None:
    """`BaseChatModel.stream` gives ``_stream`` no run manager; `ChatPCR.stream` still finds its run's span."""
    llm = ChatPCR(engine=engine, max_tokens=3)
    assert "".join(chunk.content for chunk in (PROMPT | llm).stream({"context": "pathlib joins paths.",
                                                                     "question": "How do paths join?"}))
    request_name = f"chat {engine.loaded.name}"
    deadline = time.monotonic() + 10
    while not any(s.name == request_name for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = list(exporter.get_finished_spans())
    (request,) = [s for s in spans if s.name == request_name]
    assert [a.attributes.get(KIND) for a in ancestors(request, spans)][:2] == ["LLM", "CHAIN"]
