"""OpenAI-shaped API errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every rejection the server makes is an `APIError`; engine exceptions map onto one with `from_engine_error`. The
messages say what to do, as the engine's own do. An unexpected exception becomes `internal_error`: a 500 whose
body holds a generic message and a request id, never the exception's text (which may hold paths, prompts or keys);
the log holds the traceback under the same id.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from pcr_rag import logs
from pcr_rag.errors import EngineClosedError, InvalidRequestError, PromptTooLongError, QueueFullError

log = logging.getLogger(__name__)

__all__ = ["APIError", "from_engine_error", "internal_error"]


class APIError(Exception):
    """An error response. ``status``: HTTP status; ``type``/``code``/``param``: as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    # ------------------------------------------------------------------------------------------ the usual ones
    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unauthorized(cls, message: str) -> APIError:
        return cls(401, message, type="authentication_error", code="invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str, served: str) -> APIError:
        return cls(404, f"The model {model!r} does not exist on this server; it serves {served!r} "
                        f"(GET /v1/models lists it)", param="model", code="model_not_found")

    @classmethod
    def too_large(cls, size: int | None, limit: int) -> APIError:
        got = f"{size} bytes" if size is not None else "more"
        return cls(413, f"request body is {got}, over this server's limit of {limit} bytes; send fewer or "
                        f"shorter documents, or start the server with a larger --max-body-bytes",
                   code="request_too_large")

    @classmethod
    def client_closed(cls) -> APIError:
        """The client went away before its answer (nginx's 499: counted in the metrics, never seen by anyone)."""
        return cls(499, "client closed the connection", type="server_error", code="client_closed_request")

    @classmethod
    def unavailable(cls, message: str) -> APIError:
        return cls(503, message, type="server_error", code="service_unavailable")


def from_engine_error(exc: Exception) -> APIError:
    """The API error for an exception `PCREngine.submit` / `announce` raised before any compute."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(429, f"{exc}; retry later", type="rate_limit_error", code="queue_full")
    if isinstance(exc, EngineClosedError):
        return APIError.unavailable("the server is shutting down; retry against another instance")
    return internal_error(exc, "engine call failed")


def internal_error(exc: BaseException, what: str) -> APIError:
    """A 500 for an unexpected exception: logged with its traceback under the request's id (`pcr_rag.logs`; a new
    one outside a request), which the body gives (the body holds no exception text)."""
    request_id = logs.request_id() or "req-" + uuid.uuid4().hex[:16]
    log.error("%s [%s]", what, request_id, exc_info=exc)
    return APIError(500, f"internal server error (request id {request_id}); the server's log has the details under "
                         f"that id", type="server_error", code="internal_error")
