"""Per-HTTP-request observability: a request id for the log lines (`pcr_rag.logs`) and, when tracing is on, a
server span joined to the client's W3C ``traceparent`` (`pcr_rag.tracing`).

The id is the client's ``X-Request-Id`` when it sends a sane one (`MAX_REQUEST_ID_CHARS` characters at most of
letters, digits and ``-_.:``), else a new one; the response echoes it in ``X-Request-Id``. Both the id and the
span are current while the request is handled (the request threads run in a copy of the context,
`ServerState.off_loop`), so the engine requests it submits log under the same id and trace as children of its span.
Each request ends with one INFO access line (method, path, status, seconds) under its id.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pcr_rag import logs, tracing

__all__ = ["MAX_REQUEST_ID_CHARS", "REQUEST_ID_HEADER", "RequestContext"]

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_SANE_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def request_id_of(headers: Headers) -> str:
    """The client's request id when it is sane (a log line must not carry a client's arbitrary text), else new."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is not None and _SANE_ID.fullmatch(given):
        return given
    return "req-" + uuid.uuid4().hex[:16]


class RequestContext:
    """ASGI middleware (the outermost): request id and server span per HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = request_id_of(headers)
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path, "pcr_rag.request_id": rid}
        started = time.perf_counter()
        status = 0
        with logs.request_scope(rid), tracing.server_span(f"{method} {path}", headers, attributes) as span:

            async def send_with_id(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                    if span is not None:
                        span.set_attribute("http.response.status_code", status)
                        if status >= 500:
                            from opentelemetry.trace import Status, StatusCode

                            span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, send_with_id)
            finally:  # the access line (uvicorn's own is off): once the response is over, or cut short
                log.info("%s %s -> %s in %.3f s", method, path, status or "no response",
                         time.perf_counter() - started)
