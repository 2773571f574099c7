"""Optional OpenTelemetry tracing: a span per request with the GenAI semantic conventions, child spans for its queue
wait, KV loads per tier, prefill compute steps and decode, a span per announcement, and W3C ``traceparent``
propagation on the HTTP calls between `pcr_rag.client.http.HTTPEngine` and `pcr-rag serve`.

When it is on: the process has a recording tracer provider, set by the application (or ``opentelemetry-instrument``)
with ``opentelemetry.trace.set_tracer_provider``, or given to pcr_rag alone with `use_tracer_provider`. Nothing to
configure in pcr_rag; the ``otel`` extra installs the API and SDK. When it is off (no provider, or opentelemetry not
imported by anyone), every entry point returns after a ``sys.modules`` look-up: this module imports opentelemetry
only once something else in the process has, so tracing off costs a request nothing and needs no install.

Request spans are retroactive. The engine already times each request (`pcr_rag.metrics.RequestMetrics`: submission,
queue, prefill, first token, end); a traced request also notes its prefix load's start and end and each prefill
step's (`RequestTrace.note_load`, `note_step`, appended on the executor thread). When the request ends its spans are
made at once with those start and end times, parented to the context current when it was submitted (a server span,
a framework's LLM span), so the executor's steps carry no tracer calls. Span tree::

    chat <model>                       submission -> last token (gen_ai.* attributes, pcr_rag.* counts)
      pcr_rag.queue                    submission -> admission into a row
      pcr_rag.prefill                  admission -> the first token's logits
        pcr_rag.kv_load <tier>         one per tier the prefix came from: lease -> the load's end (tokens, bytes)
        pcr_rag.prefill_compute        one per prefill step (tokens; other requests' steps run between them)
      pcr_rag.decode                   first token -> last token

A request that claims an announcement links to that announcement's span (`remember_announcement`), so a
framework's trace shows retrieval -> announce -> the request's prefill even though the request's parent is the LLM
call.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from concurrent.futures import Future
from typing import Any

__all__ = ["RequestTrace", "announcement_span", "capture", "enabled", "extract", "inject", "remember_announcement",
           "use_tracer_provider"]

INSTRUMENTATION = "pcr_rag"
PROVIDER_NAME = "pcr_rag"  # gen_ai.provider.name: the system that ran the model
MAX_REMEMBERED_ANNOUNCEMENTS = 4096  # announcement span contexts kept for the request that claims them

_provider: Any = None  # set by `use_tracer_provider`; None: the global provider
_tracer_of: tuple[Any, Any] = (None, None)  # (provider, its tracer): a provider makes a new tracer per call
_announcements: OrderedDict[int, Any] = OrderedDict()  # ticket id -> its announce span's SpanContext
_announcements_lock = threading.Lock()


def use_tracer_provider(provider: Any) -> None:
    """Trace pcr_rag with ``provider`` (an SDK ``TracerProvider``) instead of the global one; None goes back to the
    global provider. For applications and tests that keep pcr_rag's spans apart from the global set-up."""
    global _provider
    _provider = provider


def _tracer() -> Any:
    """pcr_rag's tracer, or None when tracing is off (see the module docstring)."""
    provider = _provider
    if provider is None:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:
            return None
        provider = trace.get_tracer_provider()
        if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            return None
    global _tracer_of
    cached_provider, tracer = _tracer_of
    if cached_provider is not provider:
        tracer = provider.get_tracer(INSTRUMENTATION)
        _tracer_of = (provider, tracer)
    return tracer


def enabled() -> bool:
    """Whether spans are recorded now."""
    return _tracer() is not None


# ------------------------------------------------------------------------------------------------ propagation
def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's W3C ``traceparent`` (and ``tracestate``, baggage) to outgoing ``headers``; nothing when
    opentelemetry is not loaded or no span is current."""
    if "opentelemetry.context" not in sys.modules:
        return
    from opentelemetry import propagate

    propagate.inject(headers)


def extract(headers: Any) -> Any:
    """The context a request's ``traceparent`` header names (an opentelemetry ``Context``), for a server span to
    join the client's trace; None when tracing is off."""
    if _tracer() is None:
        return None
    from opentelemetry import propagate

    return propagate.extract(headers)


@contextlib.contextmanager
def server_span(name: str, headers: Any, attributes: dict[str, Any]) -> Iterator[Any]:
    """A SERVER span for one HTTP request, child of the client's ``traceparent`` and current while the request is
    handled (so what it submits is its child); yields the span, or None when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(name, context=propagate.extract(headers), kind=SpanKind.SERVER,
                                      attributes=attributes) as span:
        yield span


@contextlib.contextmanager
def announcement_span(documents: int, *, client: bool = False) -> Iterator[Any]:
    """The span of one announcement (``pcr_rag.announce``): current while it runs, so its HTTP call carries it as
    ``traceparent`` (``client``: the `HTTPEngine`'s, a CLIENT span) and the server's spans are its children.
    Yields the span, or None when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span("pcr_rag.announce", kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
                                      attributes={"pcr_rag.documents": documents}) as span:
        yield span


def remember_announcement(span: Any, ticket_id: int, chunks: int) -> None:
    """Note the announcement ``ticket_id`` was made under ``span`` (from `announcement_span`; None: not traced), so
    the request that claims it links to it. Bounded: the oldest are forgotten first."""
    if span is None:
        return
    span.set_attribute("pcr_rag.announcement.id", ticket_id)
    span.set_attribute("pcr_rag.announcement.chunks", chunks)
    with _announcements_lock:
        _announcements[ticket_id] = span.get_span_context()
        while len(_announcements) > MAX_REMEMBERED_ANNOUNCEMENTS:
            _announcements.popitem(last=False)


def _claimed_announcement(ticket_id: int | None) -> Any:
    if ticket_id is None:
        return None
    with _announcements_lock:
        return _announcements.pop(ticket_id, None)


# ------------------------------------------------------------------------------------------------ requests
def capture(model: str, operation: str, kv_bytes_per_token: int, ticket_id: int | None = None) -> RequestTrace | None:
    """At submission: a `RequestTrace` parented to the current context, or None when tracing is off.
    ``operation``: the GenAI operation name ("chat", "text_completion"); ``ticket_id``: the announcement the request
    claimed (its span becomes a link)."""
    if _tracer() is None:
        return None
    from opentelemetry import context

    return RequestTrace(context.get_current(), model, operation, kv_bytes_per_token,
                        _claimed_announcement(ticket_id))


class RequestTrace:
    """One traced request's parent context and the times the engine notes only when traced (perf_counter
    seconds); `finish` makes its spans. ``steps``: (start, end, tokens) of each prefill step; ``load``: (start,
    end) of its prefix load."""

    def __init__(self, parent: Any, model: str, operation: str, kv_bytes_per_token: int, link: Any) -> None:
        self.parent = parent
        self.model = model
        self.operation = operation
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link = link
        self.steps: list[tuple[float, float, int]] = []
        self.load: tuple[float, float] | None = None
        self._load_began: float | None = None
        # perf_counter -> epoch nanoseconds (spans take wall-clock times)
        self._epoch_ns = time.time_ns()
        self._perf = time.perf_counter()

    def note_load_began(self, at: float) -> None:
        if self._load_began is None:  # a retry after a bad chunk keeps the first start
            self._load_began = at

    def note_load_done(self, at: float) -> None:
        if self._load_began is not None:
            self.load = (self._load_began, at)

    def note_step(self, start: float, end: float, tokens: int) -> None:
        self.steps.append((start, end, tokens))

    def _ns(self, perf_s: float) -> int:
        return self._epoch_ns + int((perf_s - self._perf) * 1e9)

    def finish(self, request: Any, future: Future) -> None:
        """The request ended (``future`` done): make its spans (a done-callback; never raises)."""
        try:
            self._emit(request, future)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            import logging

            logging.getLogger(__name__).debug("could not record the request's spans", exc_info=True)

    def _emit(self, request: Any, future: Future) -> None:
        tracer = _tracer()
        if tracer is None:
            return
        from opentelemetry import trace
        from opentelemetry.trace import Link, Status, StatusCode

        m, params = request.metrics, request.params
        error = None if future.cancelled() else future.exception()
        sub = request.submitted_at
        end = sub + m.e2e_s if error is None and not future.cancelled() else time.perf_counter()
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": str(request.request_id),
            "gen_ai.request.temperature": float(params.temperature),
            "gen_ai.request.top_p": float(params.top_p),
            "gen_ai.usage.input_tokens": len(request.token_ids),
            "pcr_rag.reused_tokens": m.reused_tokens,
            "pcr_rag.computed_tokens": m.computed_tokens,
            "pcr_rag.blended_tokens": m.blended_tokens,
            "pcr_rag.reuse": m.reuse,
            "pcr_rag.announced": m.announced,
        }
        if params.max_new_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_new_tokens
        if params.top_k:
            attributes["gen_ai.request.top_k"] = float(params.top_k)
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        if error is None and not future.cancelled():
            result = future.result()
            attributes["gen_ai.usage.output_tokens"] = m.generated_tokens
            attributes["gen_ai.response.finish_reasons"] = [result.finish_reason]
            attributes["pcr_rag.ttft_s"] = m.ttft_s
        links = [Link(self.link)] if self.link is not None else []
        root = tracer.start_span(f"{self.operation} {self.model}", context=self.parent, start_time=self._ns(sub),
                                 attributes=attributes, links=links)
        if error is not None or future.cancelled():
            kind = "cancelled" if future.cancelled() else type(error).__name__
            root.set_attribute("error.type", kind)
            root.set_status(Status(StatusCode.ERROR, str(error) if error is not None else kind))
        inside = trace.set_span_in_context(root)

        def child(name: str, start: float, stop: float, attrs: dict[str, Any] | None = None, ctx: Any = inside) -> Any:
            span = tracer.start_span(name, context=ctx, start_time=self._ns(start), attributes=attrs or {})
            span.end(end_time=self._ns(max(start, stop)))
            return span

        admitted = m.prompt_tokens > 0  # set when a row was given (`BatchExecutor._start`)
        at_row = sub + m.queue_s if admitted else end
        child("pcr_rag.queue", sub, at_row)
        if admitted:
            prefilled = m.prefill_s > 0
            first = at_row + m.prefill_s if prefilled else end
            prefill = tracer.start_span("pcr_rag.prefill", context=inside, start_time=self._ns(at_row), attributes={
                "pcr_rag.prompt_tokens": m.prompt_tokens, "pcr_rag.computed_tokens": m.computed_tokens,
                "pcr_rag.reused_tokens": m.reused_tokens, "pcr_rag.blended_tokens": m.blended_tokens,
                "pcr_rag.compute_s": m.prefill_compute_s,
                "pcr_rag.load_wait_s": m.load_wait_s, "pcr_rag.recomputed_after_error": m.recomputed_after_error})
            under = trace.set_span_in_context(prefill)
            if self.load is not None:
                for tier, tokens in m.reused_by_tier.items():
                    if tokens:
                        child(f"pcr_rag.kv_load {tier}", *self.load, {
                            "pcr_rag.kv.tier": tier, "pcr_rag.kv.tokens": tokens,
                            "pcr_rag.kv.bytes": tokens * self.kv_bytes_per_token}, ctx=under)
            for start, stop, tokens in self.steps:
                child("pcr_rag.prefill_compute", start, stop, {"pcr_rag.tokens": tokens}, ctx=under)
            prefill.end(end_time=self._ns(max(at_row, first)))
            if prefilled:
                child("pcr_rag.decode", first, end, {"gen_ai.usage.output_tokens": m.generated_tokens,
                                                     "pcr_rag.tpot_s": m.tpot_s})
        root.end(end_time=self._ns(end))
