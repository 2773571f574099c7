"""OpenAI request bodies as pydantic models, their parsing, and the response bodies, for `/v1/chat/completions`,
`/v1/completions`, `/v1/pcr/announce` and `/tokenize`.

The request models (`ChatCompletionRequest`, `CompletionRequest`, `AnnounceRequest`, `TokenizeRequest`) carry the
OpenAI field names and bounds and are the API's published schema (``/openapi.json``). Parsing (`parse_chat_request`,
`parse_completion_request`, `parse_body`) validates the raw body with pydantic's JSON parser (strict types: ``n``,
``max_tokens`` and ``seed`` are integers, not booleans or floats; nesting deeper than the parser's limit is a
400, not a crash) and turns it into a `GenerationRequest` (an engine prompt plus `SamplingParams`), or raises an
`APIError` (400) that names the field (``param``) and says what to send instead; nothing reaches the engine
before the whole body is valid. The OpenAI sampling names map through `SamplingParams.from_kwargs`
(``max_tokens`` / ``max_completion_tokens``, ``temperature`` (below ``GREEDY_BELOW``: greedy, as vLLM), ``top_p``,
``stop``, ``seed``). Options with no
equivalent here (``n > 1``, tools, logprobs, penalties, ...) are rejected when set to anything but their neutral
value; fields this server does not know are accepted and ignored (logged at debug level), as vLLM's models do
(``extra="allow"``). Chat's ``response_format`` (``text``, ``json_object``, ``json_schema``; also vLLM-style
``regex`` / ``grammar``) constrains the output with the engine's grammar-constrained decoding
(`pcr_rag.runtime.grammar`); a schema the grammar library rejects is a 400 naming ``response_format``.

Extensions (OpenAI clients send them through ``extra_body``):
- ``documents: [str, ...]``: the retrieved documents, each found verbatim in the messages/prompt and cached as its
  own token run (`ChatPrompt` / `FlatPrompt`, as the engine's ``generate_messages`` / ``generate_prompt``);
- ``return_token_ids: bool``: the choices carry ``token_ids`` (and ``prompt_token_ids``), as vLLM's extension; a
  stream then sends one chunk per generated token, text or not;
- completions only: ``chat_template: bool`` (default False: the prompt is continued as raw text, as OpenAI's
  legacy endpoint does; True wraps it as one user turn of the model's chat template) and ``system: str``.

Responses always carry ``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens whose KV was reused, 0
included) and ``usage.pcr``: the request's reuse by tier and its TTFT, queue and prefill times (seconds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pcr_rag.errors import InvalidRequestError
from pcr_rag.requests import ChatPrompt, FlatPrompt, GenerationResult, SamplingParams
from pcr_rag.runtime.grammar import ResponseFormat
from pcr_rag.server.errors import APIError

log = logging.getLogger(__name__)

__all__ = [
    "AnnounceRequest",
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerationRequest",
    "TokenizeRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "parse_body",
    "parse_chat_request",
    "parse_completion_request",
    "usage_body",
]

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the sampler's seed is a signed 64-bit integer
# temperatures below this sample greedily (vLLM's convention): dividing fp32 logits by a vanishing temperature
# overflows them to inf and the sampler's probabilities to NaN
GREEDY_BELOW = 1e-5

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# OpenAI options this server cannot honour, and the values that mean "off" (accepted silently).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""),
}
_WHAT_TO_DO = {
    "tools": "tool calling is not supported; remove 'tools' and describe the task in the messages",
    "functions": "function calling is not supported; remove 'functions'",
    "tool_choice": "tool calling is not supported; remove 'tool_choice'",
    "function_call": "function calling is not supported; remove 'function_call'",
    "logprobs": "log probabilities are not returned by this server; remove 'logprobs'",
    "top_logprobs": "log probabilities are not returned by this server; remove 'top_logprobs'",
    "logit_bias": "logit_bias is not supported; remove it",
    "presence_penalty": "penalties are not supported; remove 'presence_penalty' (or send 0)",
    "frequency_penalty": "penalties are not supported; remove 'frequency_penalty' (or send 0)",
    "audio": "audio output is not supported; remove 'audio'",
    "modalities": "only text output is supported; send modalities=['text'] or leave it out",
    "prediction": "predicted outputs are not supported; remove 'prediction'",
    "best_of": "best_of > 1 is not supported; send separate requests",
    "echo": "echo is not supported; prepend the prompt to the completion yourself",
    "suffix": "suffix (insertion) is not supported; remove it",
}
# fields whose errors name the element inside them (messages[2].content); others name the top-level field
_DEEP_PARAMS = ("messages", "stream_options")


# ------------------------------------------------------------------------------------------------ models
class _Body(BaseModel):
    """Strict JSON types (an integer field takes no bool or float, a bool field no 0/1), finite numbers, unknown
    fields kept aside and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _documents(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"'documents' must be a list of strings, got {_json_type(value)}")
    for i, doc in enumerate(value):
        if not isinstance(doc, str):
            raise ValueError(f"documents[{i}] is {_json_type(doc)}, not a string; send each document's text")
    return value


Documents = Annotated[list[str] | None, Field(
    None, description="pcr extension: the retrieved documents, each found verbatim in the prompt and cached as its "
                      "own token run")]


class TextPart(_Body):
    """A text part of a message's content (the only kind this server takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One turn: ``developer`` counts as ``system``; tool and function turns are not supported."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _turn(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError("each message must be an object with 'role' and 'content'")
        role = value.get("role")
        if not isinstance(role, str):
            raise ValueError(f"role must be one of {sorted(_CHAT_ROLES)}, got {_json_type(role)}")
        if role in ("tool", "function"):
            raise ValueError(f"role {role!r}: tool calling is not supported; send the tool's output as a user "
                             f"message")
        if role not in _CHAT_ROLES:
            raise ValueError(f"role must be one of {sorted(_CHAT_ROLES)}, got {_short(role)}")
        if value.get("tool_calls"):
            raise ValueError("tool_calls are not supported")
        content = value.get("content")
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"),
                                                                                              str)):
                    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                    raise ValueError(f"content holds a {kind!r} part: only text parts are supported")
        elif not isinstance(content, str):
            raise ValueError(f"content must be a string or a list of text parts, got {_json_type(content)}")
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Generation(_Body):
    """Fields both generation endpoints share."""

    model: str = Field(min_length=1, description="the id GET /v1/models lists")
    documents: Documents = None
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the server's)")
    temperature: float | None = Field(None, ge=0, le=2, description=f"0 (or below {GREEDY_BELOW}) = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="sampling seed (signed 64-bit)")
    n: int | None = Field(None, ge=1, description="choices per request: only 1 is supported")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description="vLLM extension: the choices carry token ids")
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    @field_validator("documents", mode="before")
    @classmethod
    def _document_texts(cls, value: Any) -> Any:
        return _documents(value)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema' | 'regex' | 'grammar', ...}")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError("'response_format' must be an object such as {'type': 'json_object'} or "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        return value

    @field_validator("messages", mode="before")
    @classmethod
    def _message_list(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
        return value


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt string (a list holding one string is taken too)."""

    prompt: str | list[str] = Field(description="one prompt string (or a list of exactly one)")
    chat_template: bool | None = Field(None, description="pcr extension: wrap the prompt as one user turn")
    system: str | None = Field(None, description="pcr extension: the system turn (needs chat_template)")
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1)
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not (len(value) == 1 and isinstance(value[0], str)):
            raise ValueError("'prompt' must be one string: send one request per prompt (token-id prompts are not "
                             "supported)")
        if not isinstance(value, (str, list)):
            raise ValueError("'prompt' is required and must be a string")
        return value


class AnnounceRequest(_Body):
    """``POST /v1/pcr/announce``: a retrieval's documents, before the LLM call that uses them."""

    documents: list[str] = Field(min_length=1, description="the retrieved documents, in prompt order")
    model: str | None = None
    query: str | None = None
    system: str | None = None
    prefix: str | None = None
    separator: str | None = None
    layout: Literal["auto", "rag", "flat"] = "auto"

    @field_validator("documents", mode="before")
    @classmethod
    def _some_documents(cls, value: Any) -> Any:
        _documents(value)
        if not value:
            raise ValueError("'documents' must list at least one retrieved document")
        return value


class TokenizeRequest(_Body):
    """``POST /tokenize``."""

    prompt: str
    model: str | None = None


# ------------------------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class GenerationRequest:
    """A parsed, valid request: what to submit to the engine and how to answer. ``prompt_chars``: the prompt's
    text fields stripped and summed (the character bound's measure, `pcr_rag.server.prompt_bound`)."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: ChatPrompt | FlatPrompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_chars: int = 0


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """``raw`` JSON validated into ``model``; `APIError` 400 naming the first bad field."""
    if not raw.strip():
        raise APIError.bad_request("empty request body: send a JSON object")
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        raise _api_error(exc) from None
    if parsed.model_extra:
        log.debug("%s: ignoring unknown fields %s", model.__name__, sorted(parsed.model_extra)[:20])
    return parsed


def parse_chat_request(raw: bytes) -> GenerationRequest:
    """A `/v1/chat/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid."""
    body = parse_body(raw, ChatCompletionRequest)
    _check_unsupported(body, ChatCompletionRequest)
    max_tokens = _max_tokens(body, "max_tokens", "max_completion_tokens")
    response_format = _response_format(body.response_format)
    turns = [{"role": _CHAT_ROLES[m.role], "content": m.text} for m in body.messages]
    chars = sum(len(t["content"].strip()) for t in turns)
    try:
        prompt = ChatPrompt(tuple(turns), tuple(body.documents or ()))
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="messages") from None
    return _request("chat", body, prompt, max_tokens, chars, response_format)


def parse_completion_request(raw: bytes) -> GenerationRequest:
    """A `/v1/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid."""
    body = parse_body(raw, CompletionRequest)
    _check_unsupported(body, CompletionRequest)
    text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    chat = bool(body.chat_template)
    if body.system is not None and not chat:
        raise APIError.bad_request("'system' needs 'chat_template': true (a raw prompt has no system turn); "
                                   "put the system text into the prompt instead", param="system")
    max_tokens = _max_tokens(body, "max_tokens")
    chars = len(text.strip()) + len((body.system or "").strip())
    try:
        prompt = FlatPrompt(text, tuple(body.documents or ()), chat, body.system)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="prompt") from None
    return _request("completion", body, prompt, max_tokens, chars)


def _request(kind: Literal["chat", "completion"], body: _Generation, prompt: ChatPrompt | FlatPrompt,
             max_tokens: int | None, chars: int, response_format: ResponseFormat | None = None) -> GenerationRequest:
    if body.n is not None and body.n != 1:
        raise APIError.bad_request(f"n={body.n!r} is not supported: this server returns one choice per request; "
                                   f"send {body.n} requests (with different seeds when sampling)", param="n")
    stream = bool(body.stream)
    include_usage = False
    if body.stream_options is not None:
        if not stream:
            raise APIError.bad_request("'stream_options' is only allowed with 'stream': true",
                                       param="stream_options")
        include_usage = bool(body.stream_options.include_usage)
    stop = body.stop
    if isinstance(stop, list):
        stop = [s for s in stop if s]
    temperature = body.temperature
    if temperature is not None and temperature < GREEDY_BELOW:
        temperature = 0.0
    try:
        params = SamplingParams.from_kwargs(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p,
                                            stop=stop or None, seed=body.seed, response_format=response_format)
    except InvalidRequestError as exc:  # the models' bounds come first; what is left is the engine's word
        raise APIError.bad_request(str(exc)) from None
    return GenerationRequest(kind=kind, model=body.model, prompt=prompt, params=params, stream=stream,
                             include_usage=include_usage, return_token_ids=bool(body.return_token_ids),
                             prompt_chars=chars)


def _max_tokens(body: _Generation, *names: str) -> int | None:
    values = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if len(set(values.values())) > 1:
        raise APIError.bad_request(f"{' and '.join(values)} disagree ({values}); send one of them",
                                   param=names[0])
    return next(iter(values.values()), None)


def _check_unsupported(body: _Generation, model: type[_Generation]) -> None:
    for name, neutral in _NEUTRAL.items():
        if name not in model.model_fields:
            continue
        value = getattr(body, name)
        if value not in neutral:
            raise APIError.bad_request(f"{name}={_short(value)}: {_WHAT_TO_DO[name]}", param=name)


def _response_format(fmt: dict[str, Any] | None) -> ResponseFormat | None:
    """Chat's ``response_format`` -> the engine's `ResponseFormat` (None: free text); a 400 on what the grammar
    library rejects, before any compute."""
    if fmt is None or fmt.get("type") == "text":
        return None
    try:
        return ResponseFormat.of(fmt)
    except InvalidRequestError as exc:
        raise APIError.bad_request(f"response_format: {exc}", param="response_format") from None


def _api_error(exc: ValidationError) -> APIError:
    """The first validation error as a 400: ``param`` names the field (as `_param`), the message what to send."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    kind, loc = error["type"], error["loc"]
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", error["msg"])
        return APIError.bad_request(f"the request body is not valid JSON ({detail}); send a JSON object")
    if not loc:
        return APIError.bad_request(f"the request body must be a JSON object, got {_json_type(error['input'])}")
    param = _param(loc)
    if kind == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
        if param != loc[0]:  # inside a message: say which
            message = f"{param}: {message}"
    elif kind == "missing":
        message = f"'{param}' is required"
    else:
        message = f"'{param}': {error['msg']}, got {_short(error['input'])}"
    return APIError.bad_request(message, param=param)


def _param(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as OpenAI names a parameter: ``max_tokens``, ``messages[2].content``; union members'
    tags (``str``, ``list[...]``) are left out."""
    top = str(loc[0])
    if top not in _DEEP_PARAMS:
        return top
    names = _FIELD_NAMES
    out = top
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += f".{part}"
    return out


_FIELD_NAMES = frozenset(name for m in (ChatMessage, TextPart, StreamOptions) for name in m.model_fields)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ responses
def usage_body(result: GenerationResult) -> dict[str, Any]:
    """OpenAI usage plus ``prompt_tokens_details.cached_tokens`` (reused prompt tokens) and the ``pcr`` object."""
    m = result.metrics
    completion = len(result.token_ids)
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": m.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": m.reused_tokens},
        "pcr": {
            "reused_tokens": m.reused_tokens,
            "computed_tokens": m.computed_tokens,
            "reused_by_tier": dict(m.reused_by_tier),
            "ttft_s": m.ttft_s,
            "queue_s": m.queue_s,
            "prefill_s": m.prefill_s,
            "prefill_compute_s": m.prefill_compute_s,
            "load_wait_s": m.load_wait_s,
            "e2e_s": m.e2e_s,
            "tpot_s": m.tpot_s,
            "documents_found": result.documents_found,
            "prefetch_hit_chunks": m.prefetch_hit_chunks,
            "announcement_claimed": m.announced,
        },
    }


def chat_response(rid: str, created: int, model: str, result: GenerationResult,
                  return_token_ids: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                              "logprobs": None, "finish_reason": result.finish_reason}
    if return_token_ids:
        choice["token_ids"] = list(result.token_ids)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage_body(result)}
    if return_token_ids:
        body["prompt_token_ids"] = list(result.prompt_token_ids)
    return body


def completion_response(rid: str, created: int, model: str, result: GenerationResult,
                        return_token_ids: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": result.text, "logprobs": None,
                              "finish_reason": result.finish_reason}
    if return_token_ids:
        choice["token_ids"] = list(result.token_ids)
        choice["prompt_token_ids"] = list(result.prompt_token_ids)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage_body(result)}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
               token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
