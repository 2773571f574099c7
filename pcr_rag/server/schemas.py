"""OpenAI request bodies as pydantic models, their parsing, and the response bodies, for `/v1/chat/completions`,
`/v1/completions`, `/v1/pcr/announce`, `/tokenize` and `/detokenize`.

The request models (`ChatCompletionRequest`, `CompletionRequest`, `AnnounceRequest`, `TokenizeRequest`,
`DetokenizeRequest`) carry the OpenAI (and vLLM) field names and bounds and are the API's published schema
(``/openapi.json``). `parse_body` validates the raw body with pydantic's JSON parser (strict types: ``n``,
``max_tokens`` and ``seed`` are integers, not booleans or floats; nesting deeper than the parser's limit is a
400, not a crash), or raises an `APIError` (400) that names the field (``param``) and says what to send instead;
`pcr_rag.server.translate` then turns a valid generation body into the engine call's inputs (`GenerationRequest`:
an engine prompt plus `SamplingParams`), with the same kind of 400 for what cannot be honoured; nothing reaches the
engine before the whole body is valid. The OpenAI sampling names map through `SamplingParams.from_kwargs`
(``max_tokens`` / ``max_completion_tokens``, ``temperature`` (below `GREEDY_BELOW`: greedy, as vLLM), ``top_p``,
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, and vLLM's ``top_k`` and ``repetition_penalty``);
a value the engine refuses is a 400 naming the field. Logprobs: chat takes ``logprobs: bool`` and ``top_logprobs``
(0 to 20) and answers OpenAI's ``{"content": [...], "refusal": null}``; the legacy completions endpoint takes
``logprobs: int`` (the number of alternatives, 0 to 20: the sampled token's logprob plus that many) and answers its
parallel lists (`chat_logprobs`, `completion_logprobs`). Options with no equivalent here (``functions``,
``function_call``, ``logit_bias``, ``audio``, ``modalities``, ``prediction``, ``best_of``, ``echo``, ``suffix``;
`pcr_rag.server.translate`) are rejected when set to anything but their neutral value. A field this server
does not know (at the top level or inside a message or tool; a null one counts as absent) is accepted, as vLLM's
models do (``extra="allow"``), and disclosed: the response's ``X-PCR-Ignored-Fields`` header names each one
(`pcr_rag.server.translate.ignored_fields`) and the server logs one warning line per such request.
``response_format`` (both endpoints, as vLLM: ``text``, ``json_object``, ``json_schema``; also vLLM-style
``regex`` / ``grammar``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar`` in GBNF or Lark, ``json_object``;
`pcr_rag.server.structured_outputs`) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` constrain the output with the engine's grammar-constrained decoding (`pcr_rag.model.grammar`),
exactly as the engine's own ``response_format`` (no instruction is added to the prompt); at most one of them per
request, and a format the grammar library rejects is a 400 naming the field. vLLM's sampling fields ``min_p``,
``min_tokens`` and ``ignore_eos`` map to `SamplingParams`' own.

``n`` (1 to ``MAX_CHOICES``): n independent requests of the same prompt; choice ``i`` samples with the seed
``seed + i`` (wrapped into the signed 64-bit range), so it equals a single request sent with that seed, whoever else
is decoding; without a seed every choice draws a fresh one.

Tools (chat): ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``, or ``{"type": "function", "function":
{"name": ...}}``) and ``parallel_tool_calls`` run exactly as the LangChain model `ChatPCR` runs them
(`pcr_rag.structured.with_tools`): the tools' instruction after the conversation and the answer constrained by a
grammar to one call (or, under ``auto``, a call or plain text); with ``parallel_tool_calls: true`` to one or
several calls, one per line, each returned as its own ``tool_calls`` entry (left out or false: at most one call, as
before this field was honoured). History turns (assistant ``tool_calls``, ``tool`` results) render as
`pcr_rag.structured.tool_history_turns` does, natively when the chat template renders tool calls itself.

Extensions (OpenAI clients send them through ``extra_body``):
- ``documents: [str | {"text": str, "scope": "shared" | "private" | null}, ...]``: the retrieved documents, each
  found verbatim in the messages/prompt and cached as its own token run (`ChatPrompt` / `FlatPrompt`, as the
  engine's ``generate_messages`` / ``generate_prompt``); ``scope`` is the document's sharing scope (`pcr_rag.Doc`:
  a tenant's request reuses another tenant's KV only up to its first document not marked "shared");
- ``scopes: ["shared" | "private" | null, ...]``: the scopes as a list parallel to ``documents`` (an object's own
  scope must agree with its entry);
- ``return_token_ids: bool``: the choices carry ``token_ids`` (and ``prompt_token_ids``), as vLLM's extension; a
  stream then sends one chunk per generated token, text or not;
- chat only: ``chat_template_kwargs: {...}``: extra variables for the chat template (e.g. ``{"enable_thinking":
  false}``), over the server's ``--chat-template-kwargs`` (`ChatPrompt.chat_template_kwargs`; names the engine sets
  itself, such as ``messages``, are refused);
- ``reuse: "exact" | "blend" | null``: how this request may reuse cached KV (`PCREngine.submit`'s ``reuse``;
  null or absent: the engine's ``EngineConfig.reuse``, "exact" unless the server was started with ``--reuse
  blend``). "blend" is opt-in and approximate: documents after the exact prefix are placed from their
  position-independent KV (`pcr_rag.sched.blend`), so the answer can differ from an uncached one; any other
  value is a 400 naming ``reuse`` before anything is computed. ``/v1/pcr/announce`` takes it too (for a blend
  request the documents' position-independent KV is prefetched as well);
- completions only: ``chat_template: bool`` (default False: the prompt is continued as raw text, as OpenAI's
  legacy endpoint does; True wraps it as one user turn of the model's chat template) and ``system: str``;
- completions only: ``layout: "flat" | "rag"`` (default "flat": the prompt is the rendered text, holding the
  documents verbatim, `FlatPrompt`). "rag" is the engine's own layout (`RagPrompt`, as `PCREngine.generate`):
  ``prompt`` is the question, and the server renders ``[system + instruction][doc 1]..[doc k][system_tail]
  [question]`` as one user turn of the chat template (so ``chat_template`` must be left out or true);
- ``system_tail: str``: the per-request part of the instructions (a date, a user profile), placed after the
  documents and before the question, so the documents' cached KV is reused across requests whose tails differ
  (`RagPrompt.system_tail`; it changes the prompt, the caller's choice). Only a ``layout: "rag"`` completion has a
  place for it that the server chooses: a chat's messages and a flat prompt are laid out by the caller, who puts
  the text after the documents there; sent with either it is a 400 naming ``system_tail`` (never dropped). Its
  characters count in the prompt's character bound (`pcr_rag.server.prompt_bound`), as the documents', the
  ``system``'s and the question's do.

Responses always carry ``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens whose KV was reused
exactly, 0 included) and ``usage.prompt_tokens_details.blended_tokens`` (the prompt tokens placed by blend mode,
approximate KV; 0 for a request served exactly), and ``usage.pcr``: the request's reuse by tier, its blended tokens,
``reuse`` (how it was served: "exact", or "blend"; a blend request whose namespace the blend gate turned exact says
"exact") and its TTFT, queue and prefill times (seconds). ``computed_tokens + reused_tokens + blended_tokens ==
prompt_tokens``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pcr_rag.metrics import REUSE_MODES
from pcr_rag.request import (
    GREEDY_BELOW,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    GenerationResult,
    chat_logprobs,
    completion_logprobs,
)
from pcr_rag.server.errors import APIError
from pcr_rag.server.tools import AnswerMessage

log = logging.getLogger(__name__)

__all__ = [
    "AnnounceRequest",
    "CHAT_ROLES",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "MAX_CHOICES",
    "TokenizeRequest",
    "chat_chunk",
    "chat_response",
    "check_token_ids",
    "completion_chunk",
    "completion_response",
    "json_type",
    "parse_body",
    "short",
    "usage_body",
]

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the sampler's seed is a signed 64-bit integer
# choices per request at most: each is a request of its own in the engine's queue, so one body cannot fill it
MAX_CHOICES = 8

# a plain message's role -> the role the chat template renders it as (a tool turn is rendered by translate)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TURN_ROLES = frozenset({*CHAT_ROLES, "tool"})

# fields whose errors name the element inside them (messages[2].content); others name the top-level field
_DEEP_PARAMS = ("messages", "stream_options", "tools", "tool_choice")


# ------------------------------------------------------------------------------------------------ models
class _Body(BaseModel):
    """Strict JSON types (an integer field takes no bool or float, a bool field no 0/1), finite numbers, unknown
    fields kept aside and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _documents(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"'documents' must be a list of strings or {{'text', 'scope'}} objects, got "
                         f"{json_type(value)}")
    for i, doc in enumerate(value):
        if not isinstance(doc, (str, dict)):
            raise ValueError(f"documents[{i}] is {json_type(doc)}; send each document's text, or "
                             f"{{'text': ..., 'scope': 'shared' | 'private' | null}}")
    return value


def _reuse_mode(value: Any) -> Any:
    """The ``reuse`` field: "exact", "blend" or null; anything else a 400 naming it (before any compute)."""
    if value is not None and value not in REUSE_MODES:
        raise ValueError(f"'reuse' must be one of {', '.join(repr(m) for m in REUSE_MODES)} or null (the server's "
                         f"default), got {short(value)}")
    return value


Scope = Literal["shared", "private"] | None


class DocumentIn(_Body):
    """A retrieved document with its sharing scope (`pcr_rag.Doc`); null: the request's default (private for a
    tenant's request)."""

    text: str
    scope: Scope = None


Documents = Annotated[list[str | DocumentIn] | None, Field(
    None, description="pcr extension: the retrieved documents (a text, or {text, scope}), each found verbatim in the "
                      "prompt and cached as its own token run")]
Scopes = Annotated[list[Scope] | None, Field(
    None, description="pcr extension: one sharing scope per document ('shared', 'private' or null)")]


class ToolCallFunction(_Body):
    name: str
    arguments: str = Field(description="the call's arguments: a JSON object as text")


class ToolCallIn(_Body):
    """An assistant's earlier tool call, as the API returned it."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="as OpenAI: letters, digits, _ and -, 64 at most")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON schema (an object schema)")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class TextPart(_Body):
    """A text part of a message's content (the only kind this server takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One turn: ``developer`` counts as ``system``; an assistant turn may carry ``tool_calls`` (its content may
    then be null), a ``tool`` turn is a call's result (``tool_call_id`` names the call); legacy ``function`` turns
    are not supported."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _turn(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError("each message must be an object with 'role' and 'content'")
        role = value.get("role")
        if not isinstance(role, str):
            raise ValueError(f"role must be one of {sorted(CHAT_ROLES)}, got {json_type(role)}")
        if role == "function":
            raise ValueError("role 'function' (legacy function calling) is not supported; send the result as a "
                             "'tool' message with its 'tool_call_id'")
        if role not in _TURN_ROLES:
            raise ValueError(f"role must be one of {sorted(_TURN_ROLES)}, got {short(role)}")
        if value.get("tool_calls") is not None and role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {role!r} ones")
        if role == "tool" and not isinstance(value.get("tool_call_id"), str):
            raise ValueError("a 'tool' message needs the 'tool_call_id' (a string) of the call it answers")
        content = value.get("content")
        if content is None and role == "assistant" and value.get("tool_calls"):
            pass  # a call without text
        elif isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"),
                                                                                              str)):
                    kind = part.get("type") if isinstance(part, dict) else json_type(part)
                    raise ValueError(f"content holds a {kind!r} part: only text parts are supported")
        elif not isinstance(content, str):
            raise ValueError(f"content must be a string or a list of text parts, got {json_type(content)}")
        return value


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Generation(_Body):
    """Fields both generation endpoints share."""

    model: str = Field(min_length=1, description="the id GET /v1/models lists")
    documents: Documents = None
    scopes: Scopes = None
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the server's)")
    temperature: float | None = Field(None, ge=0, le=2, description=f"0 (or below {GREEDY_BELOW}) = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="sampling seed (signed 64-bit)")
    n: int | None = Field(None, ge=1, description=f"choices per request (at most {MAX_CHOICES}); choice i samples with "
                                                  f"seed + i")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description="vLLM extension: the choices carry token ids")
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: a generated token's logit "
                                                                          "loses this once it appeared")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: a generated token's logit "
                                                                            "loses this per time it appeared")
    top_k: int | None = Field(None, ge=-1, description="vLLM extension: sample among the k most likely tokens; 0 "
                                                       "or -1 = all")
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX,
        description="vLLM extension: the logits of the prompt's and the answer's tokens divided by it (1 = off)")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema' | 'regex' | 'grammar', ...}")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM extension: exactly one of {'json': schema, 'regex': str, 'choice': [str], 'grammar': "
                          "GBNF or Lark, 'json_object': true}")
    guided_json: dict[str, Any] | str | None = Field(None, description="older vLLM: structured_outputs.json")
    guided_regex: str | None = Field(None, description="older vLLM: structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="older vLLM: structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="older vLLM: structured_outputs.grammar")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension: when sampling, drop tokens less "
                                                             "likely than min_p times the most likely")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension: no end of sequence or stop string "
                                                          "before this many tokens")
    ignore_eos: bool | None = Field(None, description="vLLM extension: go on past the end-of-sequence token")
    reuse: Literal["exact", "blend"] | None = Field(
        None, description="pcr extension: 'exact' (prefix reuse only; answers never depend on the cache) or 'blend' "
                          "(opt-in, approximate: documents after the exact prefix are placed from their "
                          "position-independent KV); null: the server's default (EngineConfig.reuse)")
    system_tail: str | None = Field(
        None, description="pcr extension: per-request instructions (a date, a user profile) placed after the "
                          "documents and before the question, so the documents stay reused across requests whose "
                          "tails differ; it changes the prompt. Only with /v1/completions and layout 'rag' (the "
                          "server's layout); a chat's messages or a flat prompt are laid out by the caller, so there "
                          "it is a 400")

    @field_validator("documents", mode="before")
    @classmethod
    def _document_texts(cls, value: Any) -> Any:
        return _documents(value)

    @field_validator("reuse", mode="before")
    @classmethod
    def _reuse_mode(cls, value: Any) -> Any:
        return _reuse_mode(value)

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError("'response_format' must be an object such as {'type': 'json_object'} or "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        return value


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="return each generated token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="alternatives per token with their logprobs (needs logprobs)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra chat-template variables, e.g. {'enable_thinking': false}")
    tools: list[Tool] | None = Field(None, description="functions the model may call (one call per answer unless "
                                                       "parallel_tool_calls)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="true: an answer may hold several calls (default: "
                                                               "at most one)")
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

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
    system: str | None = Field(None, description="pcr extension: the system turn (needs chat_template, or layout "
                                                  "'rag')")
    layout: Literal["flat", "rag"] | None = Field(
        None, description="pcr extension: 'flat' (default: the prompt is the rendered text, holding the documents "
                          "verbatim) or 'rag' (the prompt is the question; the server lays out [system + "
                          "instruction][documents][system_tail][question] in the chat template, as "
                          "PCREngine.generate)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="legacy: return logprobs with this many alternatives per token")
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

    documents: list[str | DocumentIn] = Field(min_length=1, description="the retrieved documents (a text, or "
                                                                       "{text, scope}), in prompt order")
    scopes: Scopes = None
    model: str | None = None
    query: str | None = None
    system: str | None = None
    prefix: str | None = None
    separator: str | None = None
    layout: Literal["auto", "rag", "flat"] = "auto"
    reuse: Literal["exact", "blend"] | None = Field(
        None, description="pcr extension: the coming request's reuse mode ('blend' also prefetches the documents' "
                          "position-independent KV); null: the server's default (EngineConfig.reuse)")

    @field_validator("documents", mode="before")
    @classmethod
    def _some_documents(cls, value: Any) -> Any:
        _documents(value)
        if not value:
            raise ValueError("'documents' must list at least one retrieved document")
        return value

    @field_validator("reuse", mode="before")
    @classmethod
    def _reuse_mode(cls, value: Any) -> Any:
        return _reuse_mode(value)


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` tokenized as the completions endpoint tokenizes it, or chat
    ``messages`` rendered with the chat template first, as /v1/chat/completions renders them (generation prompt
    appended, ``chat_template_kwargs`` over the server's)."""

    prompt: str | None = Field(None, description="a raw prompt (send this or messages)")
    messages: list[ChatMessage] | None = Field(None, description="a conversation, rendered with the chat template")
    model: str | None = None
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens (e.g. BOS); "
                                                              "default false: the tokens the engine runs")
    add_generation_prompt: bool | None = Field(None, description="messages only: must be true (the default): the "
                                                                 "engine always appends the generation prompt")
    continue_final_message: bool | None = Field(None, description="messages only: must be false (the default)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages only: template variables")
    return_token_strs: bool | None = Field(None, description="also return each token's string")

    @field_validator("messages", mode="before")
    @classmethod
    def _message_list(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, list) or not value):
            raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
        return value


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    tokens: list[int] = Field(description="token ids of this server's tokenizer")
    model: str | None = None


# ------------------------------------------------------------------------------------------------ parsing
M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """``raw`` JSON validated into ``model``; `APIError` 400 naming the first bad field."""
    if not raw.strip():
        raise APIError.bad_request("empty request body: send a JSON object")
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        raise _api_error(exc) from None
    return parsed


def check_token_ids(ids: Sequence[int], vocab_size: int, max_tokens: int) -> None:
    """A 400 naming ``tokens`` for more than ``max_tokens`` ids or an id outside ``[0, vocab_size)``."""
    if len(ids) > max_tokens:
        raise APIError.bad_request(f"{len(ids)} tokens are more than this server's max_model_len ({max_tokens}); "
                                   f"send fewer", param="tokens")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError.bad_request(f"tokens[{bad}]={ids[bad]} is not a token id of this model (0 to "
                                   f"{vocab_size - 1})", param="tokens")


def _api_error(exc: ValidationError) -> APIError:
    """The first validation error as a 400: ``param`` names the field (as `_param`), the message what to send."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    kind, loc = error["type"], error["loc"]
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", error["msg"])
        return APIError.bad_request(f"the request body is not valid JSON ({detail}); send a JSON object")
    if not loc:
        return APIError.bad_request(f"the request body must be a JSON object, got {json_type(error['input'])}")
    param = _param(loc)
    if kind == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
        if param != loc[0]:  # inside a message: say which
            message = f"{param}: {message}"
    elif kind == "missing":
        message = f"'{param}' is required"
    else:
        message = f"'{param}': {error['msg']}, got {short(error['input'])}"
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


_FIELD_NAMES = frozenset(name for m in (ChatMessage, TextPart, StreamOptions, ToolCallIn, ToolCallFunction, Tool,
                                        FunctionDef, NamedToolChoice, FunctionName) for name in m.model_fields)


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ responses
def usage_body(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """OpenAI usage plus ``prompt_tokens_details`` (``cached_tokens``: prompt tokens reused exactly;
    ``blended_tokens``: prompt tokens placed by blend mode, approximate) and the ``pcr`` object, of a request's
    choices: the prompt counts once (the first choice's prompt and reuse figures, as OpenAI counts it), the
    completion tokens of every choice are summed. ``pcr.reuse`` is how the first choice was served."""
    first = results[0]
    m = first.metrics
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": m.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": m.reused_tokens, "blended_tokens": m.blended_tokens},
        "pcr": {
            "reused_tokens": m.reused_tokens,
            "computed_tokens": m.computed_tokens,
            "blended_tokens": m.blended_tokens,
            "reuse": m.reuse,
            "reused_by_tier": dict(m.reused_by_tier),
            "ttft_s": m.ttft_s,
            "queue_s": m.queue_s,
            "prefill_s": m.prefill_s,
            "prefill_compute_s": m.prefill_compute_s,
            "load_wait_s": m.load_wait_s,
            "e2e_s": m.e2e_s,
            "tpot_s": m.tpot_s,
            "documents_found": first.documents_found,
            "prefetch_hit_chunks": m.prefetch_hit_chunks,
            "announcement_claimed": m.announced,
        },
    }


def chat_response(rid: str, created: int, model: str, results: Sequence[GenerationResult], return_token_ids: bool,
                  answers: Sequence[AnswerMessage]) -> dict[str, Any]:
    """A chat completion: choice ``i`` is ``results[i]``, its message ``answers[i]`` (text or tool call)."""
    choices: list[dict[str, Any]] = []
    for index, (result, answer) in enumerate(zip(results, answers)):
        choice: dict[str, Any] = {"index": index, "message": answer.message(),
                                  "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
                                  "finish_reason": answer.finish_reason}
        if return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(results)}
    if return_token_ids:
        body["prompt_token_ids"] = list(results[0].prompt_token_ids)
    return body


def completion_response(rid: str, created: int, model: str, results: Sequence[GenerationResult],
                        return_token_ids: bool) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index, result in enumerate(results):
        logprobs = None if result.logprobs is None else completion_logprobs(result.logprobs)
        choice: dict[str, Any] = {"index": index, "text": result.text, "logprobs": logprobs,
                                  "finish_reason": result.finish_reason}
        if return_token_ids:
            choice["token_ids"] = list(result.token_ids)
            choice["prompt_token_ids"] = list(result.prompt_token_ids)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(results)}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
               token_ids: list[int] | None = None, *, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chat stream chunk; ``logprobs``: the `chat_logprobs` of the tokens it carries (None: none)."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     token_ids: list[int] | None = None, *, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One completions stream chunk; ``logprobs``: the `completion_logprobs` of the tokens it carries."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
