"""A LangChain RAG chain traced by OpenInference's instrumentor (OpenTelemetry) shows the retriever, the announcement
it made, and the chat model's call with the engine's request under it, in one trace (`pcr_rag.tracing`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, PCRRetrievalCallback

from pcr_rag import tracing

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
