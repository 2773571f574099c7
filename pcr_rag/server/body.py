"""Reading a request's body within the server's byte limit, as the POST routes do before anything else."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from pcr_rag.server.errors import APIError

__all__ = ["BODY_TIMEOUT_STATE", "read_body"]

BODY_TIMEOUT_STATE = "pcr_body_timed_out"
"""Key the connection guard (`pcr_rag.server.lifecycle`) sets in a request's ASGI ``scope["state"]`` when it closed
the connection because the body came too slowly."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body: 413 past ``limit`` bytes (by Content-Length or as it streams in); 499 when the client
    went away while sending it, 408 when the connection guard closed it for sending too slowly."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError.too_large(int(length), limit)
    parts: list[bytes] = []
    size = 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError.too_large(None, limit)
            parts.append(part)
    except ClientDisconnect:
        if request.scope.get("state", {}).get(BODY_TIMEOUT_STATE):
            raise APIError(408, "the request body did not arrive in time; send it faster or in a smaller request",
                           code="request_timeout") from None
        raise APIError.client_closed() from None
    return b"".join(parts)
