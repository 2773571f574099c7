"""``POST /v1/completions``: the body parsed (`pcr_rag.server.schemas`), the server's cheap checks (503 while
draining, 404 for another model) before anything is compiled, then translated
(`pcr_rag.server.translate.translate_completion`), submitted (`ServerState.submit`) and answered
(`pcr_rag.server.generation.respond`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pcr_rag.handle import RequestHandle
from pcr_rag.server import openapi as api_components
from pcr_rag.server.auth import Tenant
from pcr_rag.server.body import read_body
from pcr_rag.server.generation import abandon, respond
from pcr_rag.server.routes.deps import server_state, tenant
from pcr_rag.server.schemas import CompletionRequest, parse_body
from pcr_rag.server.state import ServerState
from pcr_rag.server.translate import GenerationRequest, translate_completion

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions", openapi_extra=api_components.body(CompletionRequest),
             responses={200: api_components.generation_ok(api_components.Completion),
                        **api_components.GENERATION_ERRORS})
async def completions(request: Request, who: Tenant = Depends(tenant),
                      state: ServerState = Depends(server_state)) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    req, handles = await state.off_loop(_submit, state, raw, who, orphan=abandon)
    return await respond(request, state, req, handles)


def _submit(state: ServerState, raw: bytes, who: Tenant) -> tuple[GenerationRequest, list[RequestHandle]]:
    """On a request thread: parse, check (before any grammar is compiled), translate, submit."""
    body = parse_body(raw, CompletionRequest)
    state.check_accepting()
    state.check_model(body.model)
    req = translate_completion(body, state.engine.limits)
    return req, state.submit(req, who)
