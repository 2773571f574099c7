"""Log lines that name their request: a request id in a context variable, a filter that puts it on every record,
and the commands' root handler in text or JSON (``pcr-rag serve --log-format json``, which also turns the model loaders'
progress bars off, so stderr holds JSON lines only).

The id: `pcr-rag serve` sets it per HTTP request (the client's ``X-Request-Id`` when it sends a sane one, else a new
one; echoed in the response); `PCREngine.submit` keeps the id current at submission (else ``req-<request_id>``) on
the request (`Request.log_id`), and the executor thread makes it current while it runs that request's phases, so
the engine's lines about a request carry the same id as the server's. Lines outside any request carry ``-``.

JSON lines come from python-json-logger (the ``serve`` extra): ``timestamp``, ``level``, ``logger``, ``message``,
``request_id``, and ``trace_id`` / ``span_id`` (hex) while an OpenTelemetry span is current (`pcr_rag.tracing`), so
a log line finds its trace.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal, TextIO, get_args

__all__ = ["LOG_FORMATS", "REQUEST_ID", "LogFormat", "RequestIdFilter", "install", "request_id", "request_scope"]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
NO_REQUEST = "-"

REQUEST_ID: ContextVar[str | None] = ContextVar("pcr_rag_request_id", default=None)


def request_id() -> str | None:
    """The id of the request being handled in this context, or None."""
    return REQUEST_ID.get()


@contextlib.contextmanager
def request_scope(rid: str | None) -> Iterator[None]:
    """Make ``rid`` the current request id for the block (None: no request)."""
    token = REQUEST_ID.set(rid)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts ``request_id`` (and, while a span is current, ``trace_id`` / ``span_id``) on every record that passes
    the handler it is attached to; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get() or NO_REQUEST
        trace = sys.modules.get("opentelemetry.trace")
        if trace is not None and not hasattr(record, "trace_id"):
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = format(ctx.trace_id, "032x")
                record.span_id = format(ctx.span_id, "016x")
        return True


def formatter(fmt: LogFormat) -> logging.Formatter:
    """The formatter of ``fmt`` ("text" or "json"; ValueError otherwise)."""
    if fmt == "text":
        return logging.Formatter(TEXT_FORMAT)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter("%(levelname)s %(name)s %(message)s %(request_id)s",
                             rename_fields={"levelname": "level", "name": "logger"}, timestamp=True)
    raise ValueError(f"log format must be one of {list(LOG_FORMATS)}, got {fmt!r}")


class _StderrHandler(logging.StreamHandler):
    """A stream handler on the current ``sys.stderr``, looked up per record as logging's last resort does (a
    replaced stderr, e.g. a test's capture, is followed rather than written to after it closed)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


_installed: logging.Handler | None = None


def install(fmt: LogFormat = "text", level: int | None = None, stream: TextIO | None = None) -> logging.Handler:
    """The root logger's handler for a command: one stream handler (stderr by default) with ``fmt``'s formatter and
    the `RequestIdFilter`, replacing the one an earlier call installed (so `pcr-rag serve` can switch to JSON
    after its flags are parsed); other handlers stay. ``level``: the root level (None: unchanged)."""
    global _installed
    root = logging.getLogger()
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(formatter(fmt))
    handler.addFilter(RequestIdFilter())
    if _installed is not None:
        root.removeHandler(_installed)
    root.addHandler(handler)
    _installed = handler
    if level is not None:
        root.setLevel(level)
    if fmt == "json":
        _disable_progress_bars()
    return handler


def _disable_progress_bars() -> None:
    """JSON logs: stderr carries JSON lines only, so the model loaders' progress bars (transformers',
    huggingface_hub's tqdm bars) are turned off."""
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
