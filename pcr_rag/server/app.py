"""The OpenAI-compatible app over one `PCREngine`: `create_app` assembles it from the parts below.

Request flow: authenticate (401, `pcr_rag.server.routes.deps`) -> read the body within ``max_body_bytes`` (413; a
client gone meanwhile: 499; `pcr_rag.server.body`) -> on a request thread (never on the event loop): validate the
JSON against the route's pydantic model (400, `pcr_rag.server.schemas`), check the model (404), translate the body
into the engine call's inputs (400, `pcr_rag.server.translate`), reject a prompt whose text alone is over the
character bound (400 ``context_length_exceeded``, `pcr_rag.server.prompt_bound`), then `PCREngine.submit`
(tokenizes, compiles a grammar; 400 ``context_length_exceeded``, 429 queue full, 503 closing;
`ServerState.submit`). Every rejection happens before the request reaches the engine's queue, so none of them pins
a chunk. A request with ``n`` choices is ``n`` engine requests (choice ``i`` seeded ``seed + i``,
`GenerationRequest.choice_params`); a choice the engine refuses cancels the ones already submitted. Accepted
requests are tracked until they end; a client that disconnects cancels its requests (stream or not; counted as
499), and shutdown cancels whatever is still running (`pcr_rag.server.generation`).

The event loop only moves bytes and awaits: parsing, rendering, tokenizing, grammar compiling and announcing run
on ``request_threads`` worker threads (`ServerState.off_loop`), so ``/health`` and other requests' tokens keep
flowing while a large body is processed. An unexpected exception answers 500 with a generic message and a request
id; the log holds the traceback under that id, the body never holds exception text (`pcr_rag.server.handlers`).

Routes (`pcr_rag.server.routes`, one router per module): ``POST /v1/chat/completions``, ``POST /v1/completions``
(SSE with ``stream: true``), ``GET /v1/models``, ``POST /v1/pcr/announce`` (a retrieval's documents enter the
prefetch window; returns a ticket), ``DELETE /v1/pcr/announce/{ticket}`` (withdraw it), vLLM's ``POST /tokenize``
(a prompt, or chat ``messages`` rendered with the chat template), ``POST /detokenize`` and ``GET /version``,
``GET /metrics`` (its own key, `MetricsGuard`), ``GET /health`` (no key), ``GET /openapi.json`` (the API's
schema). Unknown request fields are named in an ``X-PCR-Ignored-Fields`` header (`pcr_rag.server.disclosure`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pcr_rag.engine import PCREngine
from pcr_rag.server import openapi as api_components
from pcr_rag.server.body import BODY_TIMEOUT_STATE
from pcr_rag.server.handlers import InternalErrors, add_error_handlers
from pcr_rag.server.observability import RequestContext
from pcr_rag.server.routes import ROUTERS
from pcr_rag.server.settings import ServerSettings
from pcr_rag.server.state import ServerState

__all__ = ["BODY_TIMEOUT_STATE", "ServerState", "create_app"]


def create_app(engine: PCREngine, settings: ServerSettings | None = None, *, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``owns_engine`` the app closes the engine when it shuts down."""
    state = ServerState(engine, settings or ServerSettings(), owns_engine=owns_engine)
    app = FastAPI(title="pcr-rag", description="OpenAI-compatible server with PCR KV-cache reuse",
                  version=api_components.API_VERSION, lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.pcr = state
    app.add_middleware(InternalErrors, metrics=state.metrics)
    app.add_middleware(RequestContext)  # outermost: the request id and span cover everything below
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = functools.partial(api_components.app_schema, app, state.model_names)  # type: ignore[method-assign]
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's life: on its end, `ServerState.shutdown` (cancel what runs; close an owned engine)."""
    yield
    await app.state.pcr.shutdown()
