"""The API's published schema (``GET /openapi.json``): response models and the request bodies' components.

The routes read their bodies themselves (byte limit, request threads), so FastAPI does not see the request models;
`body` names a model as a route's request body and `add_request_schemas` puts the models (`pcr_rag.server.schemas`)
into the schema's components. The response models describe what the routes send; they allow extra fields, so a
client reading the schema is not surprised by the ``pcr`` extensions; `errors` lists a route's error statuses.
`app_schema` is the app's schema, built once from its routes (`pcr_rag.server.routes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from pcr_rag.server.schemas import (
    AnnounceRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

__all__ = ["API_VERSION", "GENERATION_ERRORS", "add_request_schemas", "app_schema", "body", "errors", "generation_ok"]

API_VERSION = "1.0"
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, AnnounceRequest,
                                               TokenizeRequest, DetokenizeRequest)
_REF = "#/components/schemas/{model}"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorObject(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Open):
    """Every error: OpenAI's error object."""

    error: ErrorObject


class Health(_Open):
    status: Literal["ok", "draining"]


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    pcr: dict[str, Any]


class FunctionCallOut(_Open):
    name: str
    arguments: str


class ToolCallOut(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Open):
    """The answer: ``content`` is null when it is a tool call."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprobOut(_Open):
    """A likely token at a position: its text, natural-log probability (-9999 stands for -inf) and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    """A generated token's logprob and its most likely alternatives (``top_logprobs``), most likely first."""

    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(_Open):
    """A choice's logprobs (with ``logprobs: true``), one entry per generated token."""

    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Open):
    """The legacy endpoint's logprobs (with ``logprobs: n``): parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Announcement(_Open):
    id: int
    object: Literal["pcr.announcement"]
    documents: int
    chunks: int
    expires_in_s: float


class Withdrawal(_Open):
    id: int
    object: Literal["pcr.announcement"]
    withdrawn: bool


class Tokens(_Open):
    """vLLM's tokenize response."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(_Open):
    """vLLM's detokenize response."""

    prompt: str


class Version(_Open):
    """vLLM's version response: here pcr-rag's version."""

    version: str


def body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` naming ``model`` as its required JSON request body."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# one server-sent event (OpenAPI 3.1: an event stream's schema describes each event): ``data`` holds a chunk's
# JSON, an error object, or ``[DONE]``
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}


def generation_ok(model: type[BaseModel]) -> dict[str, Any]:
    """A generation route's 200: ``model`` as JSON, or an SSE stream with ``stream: true``."""
    return {"model": model, "description": "the answer (JSON), or with stream=true an SSE stream of chunks",
            "content": {"text/event-stream": {"schema": _SSE_EVENT}}}


def add_request_schemas(schema: dict[str, Any], model_names: Iterable[str]) -> None:
    """Put the request models (and the models they use) into ``schema``'s components; their ``model`` field lists
    the ``model_names`` this server answers to (any other gets 404)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    names = sorted(model_names)
    for model in REQUEST_MODELS:
        js = model.model_json_schema(ref_template=_REF, mode="validation")
        components.update(js.pop("$defs", {}))
        field = js["properties"]["model"]
        if "anyOf" in field:  # optional: a name or null
            field["anyOf"] = [{"type": "string", "enum": names}, {"type": "null"}]
        else:
            field.update(enum=names)
            field.pop("minLength", None)
        components[model.__name__] = js


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's error responses: each of ``statuses`` answers an `ErrorResponse`."""
    return {status: {"model": ErrorResponse} for status in statuses}


GENERATION_ERRORS = errors(400, 401, 404, 408, 413, 429, 500, 503, 504)
"""The error statuses of the generation routes (``/v1/chat/completions``, ``/v1/completions``)."""


def app_schema(app: FastAPI, model_names: Iterable[str]) -> dict[str, Any]:
    """``app``'s OpenAPI schema with the request models (`add_request_schemas`), built on first use and kept in
    ``app.openapi_schema`` (the app's ``openapi`` method)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        add_request_schemas(schema, model_names)
        app.openapi_schema = schema
    return app.openapi_schema
