"""``GET /version`` (vLLM's): the pcr-rag version serving."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from pcr_rag import __version__
from pcr_rag.server import openapi as api_components
from pcr_rag.server.auth import Tenant
from pcr_rag.server.routes.deps import tenant

__all__ = ["router"]

router = APIRouter()


@router.get("/version", response_model=api_components.Version, responses=api_components.errors(401))
async def version(who: Tenant = Depends(tenant)) -> JSONResponse:
    return JSONResponse({"version": __version__})
