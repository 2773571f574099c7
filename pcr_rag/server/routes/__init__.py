"""The app's routes, one `fastapi.APIRouter` per module, named by what it serves:

- `health`: ``GET /health`` (no key: the load balancer's probe);
- `metrics`: ``GET /metrics`` (Prometheus; its own key, `MetricsGuard`);
- `models`: ``GET /v1/models``;
- `chat`: ``POST /v1/chat/completions``; `completions`: ``POST /v1/completions`` (both SSE with ``stream: true``,
  through `pcr_rag.server.generation`);
- `announce`: ``POST /v1/pcr/announce`` (a retrieval's documents enter the prefetch window; returns a ticket) and
  ``DELETE /v1/pcr/announce/{ticket}`` (withdraw it);
- `tokenize`: vLLM's ``POST /tokenize`` (a prompt, or chat ``messages`` rendered with the chat template) and
  ``POST /detokenize``; `version`: ``GET /version``;
- `openapi`: ``GET /openapi.json`` (the API's schema, `pcr_rag.server.openapi.app_schema`).

A route takes what it needs from the app's `ServerState` through the dependencies in `deps` (`server_state`, the
caller's `tenant`), never from a closure. `ROUTERS` lists them in the order the app includes them, which is the
order of the paths in the OpenAPI schema.
"""

from __future__ import annotations

from fastapi import APIRouter

from pcr_rag.server.routes import (
    announce,
    chat,
    completions,
    health,
    metrics,
    models,
    openapi,
    tokenize,
    version,
)

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (health.router, metrics.router, models.router, chat.router, completions.router,
                                  announce.router, tokenize.router, version.router, openapi.router)
