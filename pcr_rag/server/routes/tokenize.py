"""vLLM's ``POST /tokenize`` (a prompt as the completions endpoint tokenizes it, or chat ``messages`` rendered with
the chat template first, `pcr_rag.server.translate.tokenize_text`) and ``POST /detokenize`` (token ids back to
text), each worked out on a request thread."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pcr_rag.server import openapi as api_components
from pcr_rag.server.auth import Tenant
from pcr_rag.server.body import read_body
from pcr_rag.server.disclosure import disclose
from pcr_rag.server.routes.deps import server_state, tenant
from pcr_rag.server.schemas import (
    DetokenizeRequest,
    TokenizeRequest,
    check_token_ids,
    parse_body,
)
from pcr_rag.server.state import ServerState
from pcr_rag.server.translate import ignored_fields, tokenize_text

__all__ = ["router"]

router = APIRouter()


@router.post("/tokenize", openapi_extra=api_components.body(TokenizeRequest),
             response_model=api_components.Tokens, responses=api_components.errors(400, 401, 404, 408, 413, 500))
async def tokenize(request: Request, who: Tenant = Depends(tenant),
                   state: ServerState = Depends(server_state)) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    answer, ignored = await state.off_loop(_tokenize, state, raw)
    return disclose(JSONResponse(answer), ignored, request.url.path)


@router.post("/detokenize", openapi_extra=api_components.body(DetokenizeRequest),
             response_model=api_components.Detokenized, responses=api_components.errors(400, 401, 404, 408, 413,
                                                                                        500))
async def detokenize(request: Request, who: Tenant = Depends(tenant),
                     state: ServerState = Depends(server_state)) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    answer, ignored = await state.off_loop(_detokenize, state, raw)
    return disclose(JSONResponse(answer), ignored, request.url.path)


def _tokenize(state: ServerState, raw: bytes) -> tuple[dict[str, Any], tuple[str, ...]]:
    engine = state.engine
    body = parse_body(raw, TokenizeRequest)
    state.check_model(body.model)
    text, chars = tokenize_text(body, engine.builder.render_messages, engine.tokenizer)
    state.check_chars(chars, "prompt" if body.prompt is not None else "messages")
    ids = list(engine.tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"])
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return ({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs},
            ignored_fields(body))


def _detokenize(state: ServerState, raw: bytes) -> tuple[dict[str, Any], tuple[str, ...]]:
    engine = state.engine
    body = parse_body(raw, DetokenizeRequest)
    state.check_model(body.model)
    check_token_ids(body.tokens, len(engine.tokenizer), engine.max_model_len)
    return {"prompt": engine.tokenizer.decode(body.tokens)}, ignored_fields(body)
