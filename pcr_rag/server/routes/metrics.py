"""``GET /metrics``: the Prometheus text (`pcr_rag.server.metrics`), rendered off the event loop; its own key
(`deps.metrics_reader`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

from pcr_rag.server import openapi as api_components
from pcr_rag.server.metrics import CONTENT_TYPE
from pcr_rag.server.routes.deps import metrics_reader, server_state
from pcr_rag.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics", dependencies=[Depends(metrics_reader)], response_class=PlainTextResponse,
            responses=api_components.errors(401, 403))
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
