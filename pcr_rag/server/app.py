"""The OpenAI-compatible app over one `PCREngine`: routes, request flow, tickets and shutdown.

Request flow: authenticate (401) -> read the body within ``max_body_bytes`` (413; a client gone meanwhile: 499)
-> on a request thread (never on the event loop): validate the JSON against the route's pydantic model (400,
`pcr_rag.server.schemas`), check the model (404), translate it (400, `pcr_rag.server.translate`), reject a prompt whose text alone is over the character bound
(400 ``context_length_exceeded``, `pcr_rag.server.prompt_bound`), then `PCREngine.submit` (tokenizes, compiles a
grammar; 400 ``context_length_exceeded``, 429 queue full, 503 closing). Every rejection happens before the request
reaches the engine's queue, so none of them pins a chunk. A request with ``n`` choices is ``n`` engine requests
(choice ``i`` seeded ``seed + i``, `GenerationRequest.choice_params`); a choice the engine refuses cancels the ones
already submitted. Accepted requests are tracked until they end; a client that disconnects cancels its requests
(stream or not; counted as 499), and shutdown cancels whatever is still running. With tools bound, each choice's
answer becomes a message or a stream of deltas through `pcr_rag.server.tools`.

The event loop only moves bytes and awaits: parsing, rendering, tokenizing, grammar compiling and announcing run
on ``request_threads`` worker threads (`ServerState.off_loop`), so ``/health`` and other requests' tokens keep
flowing while a large body is processed. An unexpected exception answers 500 with a generic message and a request
id; the log holds the traceback under that id, the body never holds exception text.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE with ``stream: true``), ``GET /v1/models``,
``POST /v1/pcr/announce`` (a retrieval's documents enter the prefetch window; returns a ticket),
``DELETE /v1/pcr/announce/{ticket}`` (withdraw it), vLLM's ``POST /tokenize`` (a prompt, or chat ``messages``
rendered with the chat template), ``POST /detokenize`` and ``GET /version``, ``GET /metrics`` (its own key,
`MetricsGuard`), ``GET /health`` (no key), ``GET /openapi.json`` (the API's schema). Unknown request fields are
named in an ``X-PCR-Ignored-Fields`` header (`pcr_rag.server.disclosure`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pcr_rag import __version__
from pcr_rag.engine import PCREngine
from pcr_rag.errors import EngineClosedError, RequestCancelledError
from pcr_rag.handle import RequestHandle
from pcr_rag.request import GenerationResult, StreamChunk
from pcr_rag.sched.announcements import Ticket
from pcr_rag.server import openapi as api_components
from pcr_rag.server.auth import Authenticator, MetricsGuard, Tenant
from pcr_rag.server.disclosure import disclose
from pcr_rag.server.errors import APIError, from_engine_error, internal_error
from pcr_rag.server.metrics import CONTENT_TYPE, ServerMetrics
from pcr_rag.server.observability import RequestContext
from pcr_rag.server.prompt_bound import PromptCharBound
from pcr_rag.server.schemas import (
    AnnounceRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_chunk,
    chat_response,
    check_token_ids,
    completion_chunk,
    completion_response,
    parse_body,
    usage_body,
)
from pcr_rag.server.settings import ServerSettings
from pcr_rag.server.streaming import DONE, LogprobBuffer, SSEResponse, sse
from pcr_rag.server.tools import ToolCallStream, answer_message
from pcr_rag.server.translate import (
    GenerationRequest,
    ignored_fields,
    request_documents,
    tokenize_text,
    translate_chat,
    translate_completion,
)

log = logging.getLogger(__name__)

__all__ = ["BODY_TIMEOUT_STATE", "ServerState", "create_app"]

T = TypeVar("T")

BODY_TIMEOUT_STATE = "pcr_body_timed_out"
"""Key the connection guard (`pcr_rag.server.lifecycle`) sets in a request's ASGI ``scope["state"]`` when it closed
the connection because the body came too slowly."""

class ServerState:
    """What the routes share: the engine, settings, auth, metrics, request threads, in-flight handles and
    announcement tickets."""

    def __init__(self, engine: PCREngine, settings: ServerSettings, *, owns_engine: bool) -> None:
        self.engine = engine
        self.settings = settings
        self.owns_engine = owns_engine
        self.auth = Authenticator(settings.api_keys, tenant_per_key=settings.tenant_per_key)
        self.metrics_guard = MetricsGuard(self.auth, settings.metrics_key, public=settings.metrics_public)
        self.model_name = settings.served_model_name or engine.loaded.name
        self.model_names = frozenset({self.model_name, engine.loaded.name})
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        self.char_bound = PromptCharBound.of(engine.tokenizer, engine.max_model_len)
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.request_threads,
                                                          thread_name_prefix="pcr-request")
        self.created = int(time.time())
        self.draining = False
        self.inflight: set[RequestHandle] = set()
        self._tickets: OrderedDict[int, tuple[str, Ticket]] = OrderedDict()

    async def off_loop(self, fn: Callable[..., T], *args: Any, orphan: Callable[[T], None] | None = None) -> T:
        """``fn(*args)`` on a request thread, awaited, in a copy of the caller's context (its request id and span,
        `pcr_rag.server.observability`). When the awaiting task is cancelled while ``fn`` runs, its result goes to
        ``orphan`` (e.g. a submitted request is cancelled) instead of being lost."""
        try:
            future = self.pool.submit(contextvars.copy_context().run, fn, *args)
        except RuntimeError:  # the pool is shut down: the app is shutting down
            raise APIError.unavailable("the server is shutting down; retry against another instance") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if orphan is not None:
                def adopt(done: concurrent.futures.Future) -> None:
                    if not done.cancelled() and done.exception() is None:
                        orphan(done.result())
                future.add_done_callback(adopt)
            raise

    # ------------------------------------------------------------------------------------------ requests
    def check_accepting(self) -> None:
        if self.draining or self.engine.closed:
            raise APIError.unavailable("the server is shutting down; retry against another instance")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError.model_not_found(model, self.model_name)

    def check_chars(self, chars: int, param: str) -> None:
        """400 ``context_length_exceeded`` when ``chars`` characters of prompt text cannot fit the engine's
        ``max_model_len`` tokens (no tokenizing: `PromptCharBound`)."""
        bound = self.char_bound
        if bound is not None and chars > bound.max_chars:
            raise APIError(400, f"the prompt's text has {chars} characters, so at least {bound.min_tokens(chars)} "
                                f"tokens (no token of this model covers more than {bound.chars_per_token} characters), "
                                f"which exceeds the engine's max_model_len of {bound.max_model_len} tokens; "
                                f"retrieve fewer or shorter documents", param=param,
                           code="context_length_exceeded")

    def prepare(self, kind: str, raw: bytes, tenant: Tenant) -> tuple[GenerationRequest, list[RequestHandle]]:
        """Parse, check and submit one generation request, one engine request per choice (on a request thread:
        this tokenizes). A choice the engine refuses cancels the choices already submitted."""
        body = parse_body(raw, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        self.check_accepting()  # before any grammar is validated
        self.check_model(body.model)
        req = (translate_chat(body, self.engine.tokenizer, self.engine.limits) if kind == "chat"
               else translate_completion(body, self.engine.limits))
        param = req.prompt_param
        self.check_chars(req.prompt_chars, param)
        handles: list[RequestHandle] = []
        try:
            for params in req.choice_params:
                handles.append(self.engine.submit(req.prompt, params, namespace=tenant.namespace, reuse=req.reuse))
        except Exception as exc:  # noqa: BLE001 - every pre-compute rejection becomes an API error
            for handle in handles:
                handle.close()
            error = from_engine_error(exc)
            if error.code == "context_length_exceeded":
                error.param = param
            raise error from None
        return req, handles

    def track(self, handles: list[RequestHandle]) -> None:
        """Track accepted requests until their response ends; ones submitted while the server began to drain are
        cancelled instead (503)."""
        if self.draining:
            for handle in handles:
                handle.close()
            raise APIError.unavailable("the server is shutting down; retry against another instance")
        self.inflight.update(handles)

    def finished(self, handles: list[RequestHandle]) -> None:
        """The response is over: cancel the requests that did not finish, stop tracking them."""
        for handle in handles:
            handle.close()
            self.inflight.discard(handle)

    def observe(self, result: GenerationResult) -> None:
        self.metrics.observe(result)

    # ------------------------------------------------------------------------------------------ tickets
    def keep_ticket(self, namespace: str, ticket: Ticket) -> None:
        """Remember ``ticket`` for withdrawal. Past ``max_tickets`` the claimed and expired ones are forgotten,
        then the oldest live ones, which are withdrawn from the engine's board too (a ticket nobody can withdraw
        any more must not hold the board's room until it expires)."""
        if len(self._tickets) >= self.settings.max_tickets:
            stale = [tid for tid, (_, t) in self._tickets.items() if t.claimed or t.expired]
            for tid in stale:
                del self._tickets[tid]
        while len(self._tickets) >= self.settings.max_tickets:
            _, (_, oldest) = self._tickets.popitem(last=False)
            self.engine.cancel_announcement(oldest)
        self._tickets[ticket.ticket_id] = (namespace, ticket)

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
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_engine:
            await asyncio.to_thread(self.engine.close)
            log.info("engine closed: write-back flushed, cache directory released")


_ERRORS = {status: {"model": api_components.ErrorResponse} for status in (400, 401, 403, 404, 408, 413, 429, 500,
                                                                           503, 504)}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: _ERRORS[status] for status in statuses}


def create_app(engine: PCREngine, settings: ServerSettings | None = None, *, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``owns_engine`` the app closes the engine when it shuts down."""
    settings = settings or ServerSettings()
    state = ServerState(engine, settings, owns_engine=owns_engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.shutdown()

    app = FastAPI(title="pcr-rag", description="OpenAI-compatible server with PCR KV-cache reuse",
                  version=api_components.API_VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.pcr = state
    app.add_middleware(_InternalErrors, metrics=state.metrics)
    app.add_middleware(RequestContext)  # outermost: the request id and span cover everything below

    def tenant(request: Request) -> Tenant:
        return state.auth.authenticate(request.headers.get("authorization"))

    def metrics_reader(request: Request) -> None:
        state.metrics_guard.check(request.headers.get("authorization"))

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
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("path", "query", "header", "body")]
        param = ".".join(loc) or None
        message = f"'{param}': {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
        return JSONResponse(APIError.bad_request(message, param=param).body(), status_code=400)

    # ------------------------------------------------------------------------------------------ routes
    @app.get("/health", response_model=api_components.Health, responses={503: {"model": api_components.Health}})
    async def health() -> JSONResponse:
        if state.draining or engine.closed:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(metrics_reader)], response_class=PlainTextResponse,
             responses=_errors(401, 403))
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(tenant)], response_model=api_components.ModelList,
             responses=_errors(401))
    async def models() -> JSONResponse:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pcr-rag",
                "root": engine.loaded.name, "max_model_len": engine.max_model_len,
                "pcr": {"max_new_tokens": engine.config.max_new_tokens, "context_window": engine.context_window,
                        "chunk_size": engine.config.chunk_size, "reuse": engine.config.reuse}}
        return JSONResponse({"object": "list", "data": [card]})

    generation_errors = _errors(400, 401, 404, 408, 413, 429, 500, 503, 504)

    @app.post("/v1/chat/completions", openapi_extra=api_components.body(ChatCompletionRequest),
              responses={200: api_components.generation_ok(api_components.ChatCompletion), **generation_errors})
    async def chat_completions(request: Request, who: Tenant = Depends(tenant)) -> Response:
        return await respond(request, "chat", await read_body(request, settings.max_body_bytes), who)

    @app.post("/v1/completions", openapi_extra=api_components.body(CompletionRequest),
              responses={200: api_components.generation_ok(api_components.Completion), **generation_errors})
    async def completions(request: Request, who: Tenant = Depends(tenant)) -> Response:
        return await respond(request, "completion", await read_body(request, settings.max_body_bytes), who)

    def do_announce(raw: bytes, who: Tenant) -> tuple[int, Ticket]:
        body = parse_body(raw, AnnounceRequest)
        docs = request_documents(body.documents, body.scopes)
        state.check_accepting()
        state.check_model(body.model)
        texts = (*(d.text for d in docs), body.query or "", body.system or "", body.prefix or "")
        state.check_chars(sum(len(t.strip()) for t in texts), "documents")
        try:
            ticket = engine.announce(docs, layout=body.layout, namespace=who.namespace, query=body.query,
                                     system=body.system, prefix=body.prefix, separator=body.separator,
                                     reuse=body.reuse)
        except Exception as exc:  # noqa: BLE001
            raise from_engine_error(exc) from None
        return len(docs), ticket

    @app.post("/v1/pcr/announce", openapi_extra=api_components.body(AnnounceRequest),
              response_model=api_components.Announcement, responses=_errors(400, 401, 404, 408, 413, 500, 503))
    async def announce(request: Request, who: Tenant = Depends(tenant)) -> JSONResponse:
        raw = await read_body(request, settings.max_body_bytes)
        count, ticket = await state.off_loop(do_announce, raw, who)
        state.keep_ticket(who.namespace, ticket)
        return JSONResponse({"id": ticket.ticket_id, "object": "pcr.announcement", "documents": count,
                             "chunks": len(ticket.keys), "expires_in_s": engine.config.announce_ttl_s})

    @app.delete("/v1/pcr/announce/{ticket_id}", response_model=api_components.Withdrawal,
                responses=_errors(400, 401, 404))
    async def withdraw(ticket_id: int, who: Tenant = Depends(tenant)) -> JSONResponse:
        withdrawn = state.withdraw_ticket(who.namespace, ticket_id)
        return JSONResponse({"id": ticket_id, "object": "pcr.announcement", "withdrawn": withdrawn})

    def do_tokenize(raw: bytes) -> tuple[dict[str, Any], tuple[str, ...]]:
        body = parse_body(raw, TokenizeRequest)
        state.check_model(body.model)
        text, chars = tokenize_text(body, engine.builder.render_messages, engine.tokenizer)
        state.check_chars(chars, "prompt" if body.prompt is not None else "messages")
        ids = list(engine.tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"])
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return ({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs},
                ignored_fields(body))

    @app.post("/tokenize", openapi_extra=api_components.body(TokenizeRequest),
              response_model=api_components.Tokens, responses=_errors(400, 401, 404, 408, 413, 500))
    async def tokenize(request: Request, who: Tenant = Depends(tenant)) -> Response:
        answer, ignored = await state.off_loop(do_tokenize, await read_body(request, settings.max_body_bytes))
        return disclose(JSONResponse(answer), ignored, request.url.path)

    def do_detokenize(raw: bytes) -> tuple[dict[str, Any], tuple[str, ...]]:
        body = parse_body(raw, DetokenizeRequest)
        state.check_model(body.model)
        check_token_ids(body.tokens, len(engine.tokenizer), engine.max_model_len)
        return {"prompt": engine.tokenizer.decode(body.tokens)}, ignored_fields(body)

    @app.post("/detokenize", openapi_extra=api_components.body(DetokenizeRequest),
              response_model=api_components.Detokenized, responses=_errors(400, 401, 404, 408, 413, 500))
    async def detokenize(request: Request, who: Tenant = Depends(tenant)) -> Response:
        answer, ignored = await state.off_loop(do_detokenize, await read_body(request, settings.max_body_bytes))
        return disclose(JSONResponse(answer), ignored, request.url.path)

    @app.get("/version", response_model=api_components.Version, responses=_errors(401))
    async def version(who: Tenant = Depends(tenant)) -> JSONResponse:
        return JSONResponse({"version": __version__})

    def openapi_schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            api_components.add_request_schemas(schema, state.model_names)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_schema  # type: ignore[method-assign]

    @app.get("/openapi.json", dependencies=[Depends(tenant)], include_in_schema=False)
    async def openapi() -> JSONResponse:
        """The API's schema; it names the served model, so it takes an API key as /v1/models does."""
        return JSONResponse(openapi_schema())

    # ------------------------------------------------------------------------------------------ generation
    async def respond(request: Request, kind: str, raw: bytes, who: Tenant) -> Response:
        def orphan(prepared: tuple[GenerationRequest, list[RequestHandle]]) -> None:
            for handle in prepared[1]:
                handle.close()

        req, handles = await state.off_loop(state.prepare, kind, raw, who, orphan=orphan)
        state.track(handles)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return disclose(SSEResponse(stream_events(handles, req, rid, created),
                                        on_close=lambda: state.finished(handles)), req.ignored, request.url.path)
        try:
            results = await results_or_disconnect(request, handles)
        except Exception as exc:  # noqa: BLE001 - failed or cancelled while running
            raise _failure(exc) from None
        finally:
            state.finished(handles)
        for result in results:
            state.observe(result)

        def encode() -> bytes:  # n choices of long answers with top logprobs are megabytes of JSON
            if req.kind == "chat":
                answers = [answer_message(r.text, r.finish_reason, req.tools) for r in results]
                body = chat_response(rid, created, state.model_name, results, req.return_token_ids, answers)
            else:
                body = completion_response(rid, created, state.model_name, results, req.return_token_ids)
            return _json_bytes(body)

        return disclose(Response(await state.off_loop(encode), media_type="application/json"), req.ignored,
                        request.url.path)

    async def stream_events(handles: list[RequestHandle], req: GenerationRequest, rid: str,
                            created: int) -> AsyncIterator[bytes]:
        model = state.model_name
        chat = req.kind == "chat"
        usage_field = {"usage": None} if req.include_usage else {}
        calls = [ToolCallStream(req.tools) for _ in handles]
        logprobs = [LogprobBuffer(req.kind) for _ in handles]  # each token's logprob goes with the next chunk sent

        def chunk(index: int, text: str, finish: str | None = None, token_ids: list[int] | None = None,
                  delta: dict[str, Any] | None = None) -> bytes:
            lp = logprobs[index].take()
            if chat:
                body = chat_chunk(rid, created, model, delta if delta is not None else {"content": text}, finish,
                                  token_ids, index=index, logprobs=lp)
            else:
                body = completion_chunk(rid, created, model, text, finish, token_ids, index=index, logprobs=lp)
            return sse({**body, **usage_field})

        if chat:
            for index in range(len(handles)):
                yield chunk(index, "", delta={"role": "assistant", "content": ""})
        results: list[GenerationResult | None] = [None] * len(handles)
        try:
            async for index, piece in merge_streams(handles):
                if piece.is_final:
                    result = results[index] = piece.result
                    state.observe(result)
                    if not chat:
                        yield chunk(index, "", finish=result.finish_reason)
                        continue
                    deltas, finish = calls[index].finish(result.text, result.finish_reason)
                    for delta in deltas:
                        yield chunk(index, "", delta=delta)
                    yield chunk(index, "", finish=finish, delta={})
                    continue
                token_ids = [piece.token_id] if req.return_token_ids else None
                logprobs[index].add(piece.logprobs)
                if not chat:
                    if piece.text or token_ids:
                        yield chunk(index, piece.text, token_ids=token_ids)
                    continue
                deltas = calls[index].feed(piece.text)
                if not deltas and token_ids:  # one chunk per token: a held call's token gets an empty delta
                    deltas = [{} if calls[index].calling else {"content": ""}]
                for i, delta in enumerate(deltas):
                    yield chunk(index, "", delta=delta, token_ids=token_ids if i == 0 else None)
        except Exception as exc:  # noqa: BLE001 - a request failed mid-stream: say so in the stream
            error = _failure(exc)
            state.metrics.count_error(error.status)
            yield sse(error.body())
            yield DONE
            return
        done = [r for r in results if r is not None]
        assert len(done) == len(handles)
        if req.include_usage:
            tail: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [],
                                    "usage": usage_body(done)}
            if req.return_token_ids:  # both endpoints: a client's streamed result has its prompt's ids too
                tail["prompt_token_ids"] = list(done[0].prompt_token_ids)
            yield sse(tail)
        yield DONE

    return app


# ------------------------------------------------------------------------------------------------ helpers
def _json_bytes(body: Any) -> bytes:
    """``body`` as `JSONResponse` encodes it (compact UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body: 413 past ``limit`` bytes (by Content-Length or as it streams in); 499 when the client
    went away while sending it, 408 when the connection guard closed it for sending too slowly."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError.too_large(int(length), limit)
    parts: list[bytes] = []
    size = 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError.too_large(None, limit)
            parts.append(part)
    except ClientDisconnect:
        if request.scope.get("state", {}).get(BODY_TIMEOUT_STATE):
            raise APIError(408, "the request body did not arrive in time; send it faster or in a smaller request",
                           code="request_timeout") from None
        raise APIError.client_closed() from None
    return b"".join(parts)


async def results_or_disconnect(request: Request, handles: list[RequestHandle]) -> list[GenerationResult]:
    """The handles' results, in order; cancels the requests (and raises a 499 `APIError`) when the client
    disconnects first. The first failure raises; the caller's `ServerState.finished` cancels the others."""
    results = asyncio.ensure_future(asyncio.gather(*(handle.aresult() for handle in handles)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, results):
            if not task.done():
                task.cancel()  # aresult cancels the engine request
        for task in (gone, results):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if results not in done:
        for handle in handles:
            handle.cancel()
        raise APIError.client_closed()
    return list(results.result())


async def merge_streams(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Every handle's pieces as they come, tagged with the handle's index, up to each one's final piece; a failed
    request raises here. One handle is iterated directly; several by a task each, cancelled (which cancels their
    engine requests) when the consumer stops or is cancelled."""
    if len(handles) == 1:
        async for piece in handles[0]:
            yield 0, piece
            if piece.is_final:
                return
        raise RuntimeError("the request's stream ended without its result")
    queue: asyncio.Queue[tuple[int, StreamChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for piece in handle:
                queue.put_nowait((index, piece, None))
                if piece.is_final:
                    return
            raise RuntimeError("the request's stream ended without its result")
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which answers it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            assert piece is not None
            yield index, piece
            remaining -= piece.is_final
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


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
    return internal_error(exc, "request failed")


class _InternalErrors:
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
