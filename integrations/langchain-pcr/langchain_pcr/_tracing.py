"""pcr_rag's spans (`pcr_rag.tracing`) inside a LangChain trace recorded by OpenInference's LangChain instrumentor.

That instrumentor records each LangChain run as an OpenTelemetry span but never makes it the current span (its
callbacks cannot guarantee a detach), so a span pcr_rag starts would open a trace of its own. `run_span(run_id,
...)` makes the span of the first given run that the instrumentor still holds current for a block: the retrieval
hook's announcement becomes a child of the retriever's span, and a model's request a child of the model's span
(a local engine's when submitted; an `HTTPEngine`'s HTTP call, which carries the current span as ``traceparent``,
while its handle is consumed: `langchain_pcr._base.ModelCall`). Without the instrumentor (not imported), or with
no span for those runs, it does nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from uuid import UUID

__all__ = ["run_span"]


def _span_of(run_ids: tuple[UUID | None, ...]) -> Any:
    module = sys.modules.get("openinference.instrumentation.langchain")
    if module is None:
        return None
    try:
        instrumentor = module.LangChainInstrumentor()
        for run_id in run_ids:
            if run_id is not None and (span := instrumentor.get_span(run_id)) is not None:
                return span
    except Exception:  # noqa: BLE001 - an instrumentor that is not set up: no span, never an error of the chain
        return None
    return None


@contextlib.contextmanager
def run_span(*run_ids: UUID | None) -> Iterator[None]:
    """The span OpenInference records for the first of ``run_ids`` it holds is current inside the block."""
    span = _span_of(run_ids)
    if span is None:
        yield
        return
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)
