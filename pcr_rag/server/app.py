"""The OpenAI-compatible app over one `PCREngine`: routes, request flow, tickets and shutdown.

Request flow: authenticate (401) -> read the body within ``max_body_bytes`` (413) -> parse JSON (400) -> validate
the OpenAI fields and extensions (400, `pcr_rag.server.schemas`) -> check the model (404) -> `PCREngine.submit`
(400 ``context_length_exceeded``, 429 queue full, 503 closing). Every rejection happens before the request reaches
the engine's queue, so none of them pins a chunk. Accepted requests are tracked until they end; a client that
disconnects cancels its request (stream or not), and shutdown cancels whatever is still running.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE with ``stream: true``), ``GET /v1/models``,
``POST /v1/pcr/announce`` (a retrieval's documents enter the prefetch window; returns a ticket),
``DELETE /v1/pcr/announce/{ticket}`` (withdraw it), ``POST /tokenize``, ``GET /metrics``, ``GET /health`` (the
only route without a key).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pcr_rag.engine import PCREngine
from pcr_rag.errors import EngineClosedError, RequestCancelledError
from pcr_rag.requests import GenerationResult, RequestHandle
from pcr_rag.runtime.announcements import Ticket
from pcr_rag.server.auth import Authenticator, Tenant
from pcr_rag.server.errors import APIError, from_engine_error
from pcr_rag.server.metrics import CONTENT_TYPE, ServerMetrics
from pcr_rag.server.schemas import (
    GenerationRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    parse_documents,
    usage_body,
)
from pcr_rag.server.settings import ServerSettings
from pcr_rag.server.streaming import DONE, SSEResponse, sse

log = logging.getLogger(__name__)

__all__ = ["ServerState", "create_app"]


class ServerState:
    """What the routes share: the engine, settings, auth, metrics, in-flight handles and announcement tickets."""

    def __init__(self, engine: PCREngine, settings: ServerSettings, *, owns_engine: bool) -> None:
        self.engine = engine
        self.settings = settings
        self.owns_engine = owns_engine
        self.auth = Authenticator(settings.api_keys, tenant_per_key=settings.tenant_per_key)
        self.model_name = settings.served_model_name or engine.loaded.name
        self.model_names = frozenset({self.model_name, engine.loaded.name})
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        self.created = int(time.time())
        self.draining = False
        self.inflight: set[RequestHandle] = set()
        self._tickets: OrderedDict[int, tuple[str, Ticket]] = OrderedDict()

    # ------------------------------------------------------------------------------------------ requests
    def check_accepting(self) -> None:
        if self.draining or self.engine.closed:
            raise APIError.unavailable("the server is shutting down; retry against another instance")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError.model_not_found(model, self.model_name)

    def submit(self, req: GenerationRequest, tenant: Tenant) -> RequestHandle:
        self.check_accepting()
        self.check_model(req.model)
        try:
            handle = self.engine.submit(req.prompt, req.params, namespace=tenant.namespace)
        except Exception as exc:  # noqa: BLE001 - every pre-compute rejection becomes an API error
            error = from_engine_error(exc)
            if error.code == "context_length_exceeded" and req.kind == "completion":
                error.param = "prompt"
            raise error from None
        self.inflight.add(handle)
        return handle

    def finished(self, handle: RequestHandle) -> None:
        """The response is over: cancel the request unless it finished, stop tracking it."""
        handle.close()
        self.inflight.discard(handle)

    def observe(self, result: GenerationResult) -> None:
        self.metrics.observe(result)

    # ------------------------------------------------------------------------------------------ tickets
    def keep_ticket(self, namespace: str, ticket: Ticket) -> None:
        stale = [tid for tid, (_, t) in self._tickets.items() if t.claimed or t.expired]
        for tid in stale:
            del self._tickets[tid]
        self._tickets[ticket.ticket_id] = (namespace, ticket)
        while len(self._tickets) > self.settings.max_tickets:
            self._tickets.popitem(last=False)

    def withdraw_ticket(self, namespace: str, ticket_id: int) -> bool:
        entry = self._tickets.get(ticket_id)
        if entry is not None and (entry[1].claimed or entry[1].expired):
            del self._tickets[ticket_id]
            entry = None
        if entry is None or entry[0] != namespace:
            raise APIError(404, f"no announcement {ticket_id} of yours is pending (claimed, expired or unknown)",
                           param="ticket", code="announcement_not_found")
        del self._tickets[ticket_id]
        return self.engine.cancel_announcement(entry[1])

    # ------------------------------------------------------------------------------------------ lifecycle
    def begin_drain(self) -> None:
        """Stop accepting requests (SIGTERM); in-flight ones go on."""
        if not self.draining:
            log.info("draining: new requests get 503; %d in flight", len(self.inflight))
        self.draining = True

    async def shutdown(self) -> None:
        """Cancel what is still running, then (when the app owns it) close the engine: flush write-back, release
        the cache directory's lock."""
        self.begin_drain()
        for handle in list(self.inflight):
            handle.cancel()
        self.inflight.clear()
        if self.owns_engine:
            await asyncio.to_thread(self.engine.close)
            log.info("engine closed: write-back flushed, cache directory released")


def create_app(engine: PCREngine, settings: ServerSettings | None = None, *, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``owns_engine`` the app closes the engine when it shuts down."""
    settings = settings or ServerSettings()
    state = ServerState(engine, settings, owns_engine=owns_engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.shutdown()

    app = FastAPI(title="pcr-rag", description="OpenAI-compatible server with PCR KV-cache reuse",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pcr = state

    def tenant(request: Request) -> Tenant:
        return state.auth.authenticate(request.headers.get("authorization"))

    # ------------------------------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        state.metrics.count_error(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.metrics.count_error(exc.status_code)
        message = "no such route; see the server's README for its endpoints" if exc.status_code == 404 else str(
            exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        state.metrics.count_error(400)
        return JSONResponse(APIError.bad_request(str(exc.errors())).body(), status_code=400)

    # ------------------------------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining or engine.closed:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(tenant)])
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def models() -> JSONResponse:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pcr-rag",
                "root": engine.loaded.name, "max_model_len": engine.max_model_len,
                "pcr": {"max_new_tokens": engine.config.max_new_tokens, "context_window": engine.context_window,
                        "chunk_size": engine.config.chunk_size}}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, who: Tenant = Depends(tenant)) -> Response:
        req = parse_chat_request(await read_json(request, settings.max_body_bytes))
        return await respond(request, req, who)

    @app.post("/v1/completions")
    async def completions(request: Request, who: Tenant = Depends(tenant)) -> Response:
        req = parse_completion_request(await read_json(request, settings.max_body_bytes))
        return await respond(request, req, who)

    @app.post("/v1/pcr/announce")
    async def announce(request: Request, who: Tenant = Depends(tenant)) -> JSONResponse:
        body = await read_json(request, settings.max_body_bytes)
        if not isinstance(body, dict):
            raise APIError.bad_request("the request body must be a JSON object with 'documents'")
        state.check_accepting()
        state.check_model(body.get("model"))
        documents = parse_documents(body.get("documents"))
        if not documents:
            raise APIError.bad_request("'documents' must list at least one retrieved document", param="documents")
        kwargs: dict[str, Any] = {}
        for name in ("query", "system", "prefix", "separator"):
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                raise APIError.bad_request(f"'{name}' must be a string", param=name)
            kwargs[name] = value
        layout = body.get("layout", "auto")
        if layout not in ("auto", "rag", "flat"):
            raise APIError.bad_request("'layout' must be 'auto', 'rag' or 'flat'", param="layout")
        try:
            ticket = engine.announce(documents, layout=layout, namespace=who.namespace, **kwargs)
        except Exception as exc:  # noqa: BLE001
            raise from_engine_error(exc) from None
        state.keep_ticket(who.namespace, ticket)
        return JSONResponse({"id": ticket.ticket_id, "object": "pcr.announcement", "documents": len(documents),
                             "chunks": len(ticket.keys), "expires_in_s": engine.config.announce_ttl_s})

    @app.delete("/v1/pcr/announce/{ticket_id}")
    async def withdraw(ticket_id: int, who: Tenant = Depends(tenant)) -> JSONResponse:
        withdrawn = state.withdraw_ticket(who.namespace, ticket_id)
        return JSONResponse({"id": ticket_id, "object": "pcr.announcement", "withdrawn": withdrawn})

    @app.post("/tokenize")
    async def tokenize(request: Request, who: Tenant = Depends(tenant)) -> JSONResponse:
        body = await read_json(request, settings.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise APIError.bad_request("send {'prompt': str}", param="prompt")
        state.check_model(body.get("model"))
        ids = engine.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len})

    # ------------------------------------------------------------------------------------------ generation
    async def respond(request: Request, req: GenerationRequest, who: Tenant) -> Response:
        handle = state.submit(req, who)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return SSEResponse(stream_events(handle, req, rid, created), on_close=lambda: state.finished(handle))
        try:
            result = await result_or_disconnect(request, handle)
        except Exception as exc:  # noqa: BLE001 - failed or cancelled while running
            raise _failure(exc) from None
        finally:
            state.finished(handle)
        state.observe(result)
        build = chat_response if req.kind == "chat" else completion_response
        return JSONResponse(build(rid, created, state.model_name, result, req.return_token_ids))

    async def stream_events(handle: RequestHandle, req: GenerationRequest, rid: str,
                            created: int) -> AsyncIterator[bytes]:
        model = state.model_name
        chat = req.kind == "chat"
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(text: str, finish: str | None = None, token_ids: list[int] | None = None,
                  delta: dict[str, Any] | None = None) -> bytes:
            if chat:
                body = chat_chunk(rid, created, model, delta if delta is not None else {"content": text}, finish,
                                  token_ids)
            else:
                body = completion_chunk(rid, created, model, text, finish, token_ids)
            return sse({**body, **usage_field})

        if chat:
            yield chunk("", delta={"role": "assistant", "content": ""})
        result: GenerationResult | None = None
        try:
            async for piece in handle:
                if piece.is_final:
                    result = piece.result
                    break
                if piece.text or req.return_token_ids:
                    yield chunk(piece.text, token_ids=[piece.token_id] if req.return_token_ids else None)
        except Exception as exc:  # noqa: BLE001 - the request failed mid-stream: say so in the stream
            error = _failure(exc)
            state.metrics.count_error(error.status)
            yield sse(error.body())
            yield DONE
            return
        assert result is not None
        state.observe(result)
        yield chunk("", finish=result.finish_reason, delta={} if chat else None)
        if req.include_usage:
            tail: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [],
                                    "usage": usage_body(result)}
            if req.return_token_ids and chat:
                tail["prompt_token_ids"] = list(result.prompt_token_ids)
            yield sse(tail)
        yield DONE

    return app


# ------------------------------------------------------------------------------------------------ helpers
async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON: 413 past ``limit`` bytes (by Content-Length or as it streams in), 400 when
    it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError.too_large(int(length), limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError.too_large(None, limit)
        parts.append(part)
    raw = b"".join(parts)
    if not raw:
        raise APIError.bad_request("empty request body: send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError.bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") from None


async def result_or_disconnect(request: Request, handle: RequestHandle) -> GenerationResult:
    """The handle's result; cancels the request when the client disconnects first."""
    result = asyncio.ensure_future(handle.aresult())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()  # aresult cancels the engine request
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await gone
    if result.cancelled():
        handle.cancel()
        raise APIError(499, "client closed the connection", type="server_error", code="client_closed_request")
    return result.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _failure(exc: BaseException) -> APIError:
    """The API error for a request that failed after it was accepted."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClosedError):
        return APIError.unavailable("the server shut down before this request finished; retry")
    if isinstance(exc, RequestCancelledError):
        return APIError(503, f"the request was cancelled ({exc}); retry", type="server_error", code="cancelled")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc), type="server_error", code="timeout")
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"the request failed: {type(exc).__name__}: {exc}", type="server_error")
