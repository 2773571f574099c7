"""``GET /openapi.json``: the API's schema (`pcr_rag.server.openapi.app_schema`, the app's ``openapi``); it names
the served model, so it takes an API key as ``/v1/models`` does. Left out of the schema itself."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pcr_rag.server.routes.deps import tenant

__all__ = ["router"]

router = APIRouter()


@router.get("/openapi.json", dependencies=[Depends(tenant)], include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    """The API's schema; it names the served model, so it takes an API key as /v1/models does."""
    return JSONResponse(request.app.openapi())
