"""``POST /v1/pcr/announce``: a retrieval's documents enter the engine's prefetch window before the LLM call that
uses them; the answer is a ticket, kept by the server (`ServerState.keep_ticket`) so its tenant can withdraw it
with ``DELETE /v1/pcr/announce/{ticket}`` (404 for a ticket claimed, expired, unknown or another tenant's)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pcr_rag.sched.announcements import Ticket
from pcr_rag.server import openapi as api_components
from pcr_rag.server.auth import Tenant
from pcr_rag.server.body import read_body
from pcr_rag.server.errors import from_engine_error
from pcr_rag.server.routes.deps import server_state, tenant
from pcr_rag.server.schemas import AnnounceRequest, parse_body
from pcr_rag.server.state import ServerState
from pcr_rag.server.translate import request_documents

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/pcr/announce", openapi_extra=api_components.body(AnnounceRequest),
             response_model=api_components.Announcement, responses=api_components.errors(400, 401, 404, 408, 413,
                                                                                         500, 503))
async def announce(request: Request, who: Tenant = Depends(tenant),
                   state: ServerState = Depends(server_state)) -> JSONResponse:
    raw = await read_body(request, state.settings.max_body_bytes)
    count, ticket = await state.off_loop(_announce, state, raw, who)
    state.keep_ticket(who.namespace, ticket)
    return JSONResponse({"id": ticket.ticket_id, "object": "pcr.announcement", "documents": count,
                         "chunks": len(ticket.keys), "expires_in_s": state.engine.config.announce_ttl_s})


@router.delete("/v1/pcr/announce/{ticket_id}", response_model=api_components.Withdrawal,
               responses=api_components.errors(400, 401, 404))
async def withdraw(ticket_id: int, who: Tenant = Depends(tenant),
                   state: ServerState = Depends(server_state)) -> JSONResponse:
    withdrawn = state.withdraw_ticket(who.namespace, ticket_id)
    return JSONResponse({"id": ticket_id, "object": "pcr.announcement", "withdrawn": withdrawn})


def _announce(state: ServerState, raw: bytes, who: Tenant) -> tuple[int, Ticket]:
    """On a request thread: parse, check, announce (this tokenizes the documents)."""
    body = parse_body(raw, AnnounceRequest)
    docs = request_documents(body.documents, body.scopes)
    state.check_accepting()
    state.check_model(body.model)
    texts = (*(d.text for d in docs), body.query or "", body.system or "", body.prefix or "")
    state.check_chars(sum(len(t.strip()) for t in texts), "documents")
    try:
        ticket = state.engine.announce(docs, layout=body.layout, namespace=who.namespace, query=body.query,
                                       system=body.system, prefix=body.prefix, separator=body.separator,
                                       reuse=body.reuse)
    except Exception as exc:  # noqa: BLE001
        raise from_engine_error(exc) from None
    return len(docs), ticket
