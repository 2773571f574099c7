"""``GET /health``: 200 ``{"status": "ok"}``, or 503 ``{"status": "draining"}`` once the server drains or its
engine closed (no API key: it is the load balancer's probe)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from pcr_rag.server import openapi as api_components
from pcr_rag.server.routes.deps import server_state
from pcr_rag.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


@router.get("/health", response_model=api_components.Health, responses={503: {"model": api_components.Health}})
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    if state.draining or state.engine.closed:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})
