"""What a route asks of the app, as FastAPI dependencies: the app's `ServerState` (`server_state`), the caller's
`Tenant` (`tenant`: 401 without a valid API key) and the ``/metrics`` reader's key (`metrics_reader`: 401/403).
They take nothing from the request but its app and its ``Authorization`` header, so they add nothing to the
OpenAPI schema."""

from __future__ import annotations

from fastapi import Depends, Request

from pcr_rag.server.auth import Tenant
from pcr_rag.server.state import ServerState

__all__ = ["metrics_reader", "server_state", "tenant"]


def server_state(request: Request) -> ServerState:
    """The app's `ServerState` (``app.state.pcr``, set by `pcr_rag.server.app.create_app`)."""
    return request.app.state.pcr


def tenant(request: Request, state: ServerState = Depends(server_state)) -> Tenant:
    return state.auth.authenticate(request.headers.get("authorization"))


def metrics_reader(request: Request, state: ServerState = Depends(server_state)) -> None:
    state.metrics_guard.check(request.headers.get("authorization"))
