"""How errors become responses: the exception handlers (`add_error_handlers`) and the last-resort middleware
(`InternalErrors`). Every error response has OpenAI's shape (`pcr_rag.server.errors.APIError.body`) and is counted in
the server's metrics by status (the app's `ServerState`, ``app.state.pcr``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pcr_rag.server.errors import APIError, internal_error
from pcr_rag.server.metrics import ServerMetrics

__all__ = ["InternalErrors", "add_error_handlers"]


def add_error_handlers(app: FastAPI) -> None:
    """`APIError` -> its status and body (401 with ``WWW-Authenticate: Bearer``); Starlette's HTTP errors (an
    unknown route's 404, a wrong method's 405) and FastAPI's validation errors (a path parameter's, as 400) in the
    same OpenAI shape."""
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]


def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.pcr.metrics


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    _metrics(request).count_error(exc.status)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    _metrics(request).count_error(exc.status_code)
    message = "no such route; see the server's README for its endpoints" if exc.status_code == 404 else str(
        exc.detail)
    return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _metrics(request).count_error(400)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("path", "query", "header", "body")]
    param = ".".join(loc) or None
    message = f"'{param}': {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
    return JSONResponse(APIError.bad_request(message, param=param).body(), status_code=400)


class InternalErrors:
    """ASGI middleware: an exception nothing else handled answers 500 with a generic message and a request id (the
    log holds the traceback under that id; the body holds no exception text), counted as a 500."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: never a traceback to the client
            error = internal_error(exc, f"{scope.get('method')} {scope.get('path')} failed")
            self.metrics.count_error(500)
            if started:
                return  # the response is under way: the client sees it cut short
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)
