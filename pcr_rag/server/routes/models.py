"""``GET /v1/models``: the one served model's card, with the engine's ``pcr`` figures (token limits, chunk size,
reuse mode)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from pcr_rag.server import openapi as api_components
from pcr_rag.server.routes.deps import server_state, tenant
from pcr_rag.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(tenant)], response_model=api_components.ModelList,
            responses=api_components.errors(401))
async def models(state: ServerState = Depends(server_state)) -> JSONResponse:
    engine = state.engine
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pcr-rag",
            "root": engine.loaded.name, "max_model_len": engine.max_model_len,
            "pcr": {"max_new_tokens": engine.config.max_new_tokens, "context_window": engine.context_window,
                    "chunk_size": engine.config.chunk_size, "reuse": engine.config.reuse}}
    return JSONResponse({"object": "list", "data": [card]})
