"""A LlamaIndex query traced by OpenInference's instrumentor (OpenTelemetry) shows retrieval -> announce -> LLM ->
the engine's request and its prefill in one trace (`pcr_rag.tracing`), with the SDK's in-memory exporter."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from llama_index.llms.pcr import PCRLLM

from pcr_rag import tracing

pytest.importorskip("openinference.instrumentation.llama_index")

from openinference.instrumentation.llama_index import LlamaIndexInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

KIND = "openinference.span.kind"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LlamaIndexInstrumentor()
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


def test_query_trace_shows_retrieval_announce_llm_and_prefill(engine, index, exporter) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    qe.query("How do pathlib paths join?")
    request_name = f"chat {engine.loaded.name}"
    deadline = time.monotonic() + 10
    while not any(s.name == request_name for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = list(exporter.get_finished_spans())
    assert len({s.context.trace_id for s in spans}) == 1, "one trace for the whole query"

    (announce,) = [s for s in spans if s.name == "pcr_rag.announce"]
    assert "RETRIEVER" in [a.attributes.get(KIND) for a in ancestors(announce, spans)]
    (request,) = [s for s in spans if s.name == request_name]
    above = [a.attributes.get(KIND) for a in ancestors(request, spans)]
    assert above[0] == "LLM" and "RETRIEVER" not in above  # the LLM call's child, beside the retrieval
    assert [link.context.span_id for link in request.links] == [announce.context.span_id]
    assert request.attributes["pcr_rag.announced"] is True
    assert request.attributes["gen_ai.usage.output_tokens"] > 0
    (prefill,) = [s for s in spans if s.name == "pcr_rag.prefill"]
    assert prefill.parent.span_id == request.context.span_id
    retrieve = next(s for s in spans if s.attributes.get(KIND) == "RETRIEVER")
    llm_span = next(s for s in ancestors(request, spans) if s.attributes.get(KIND) == "LLM")
    # in time too: retrieval, then its announcement, then the LLM call whose request prefills
    assert retrieve.start_time <= announce.start_time <= announce.end_time <= llm_span.start_time
    assert llm_span.start_time <= request.start_time <= prefill.start_time <= prefill.end_time <= llm_span.end_time
