"""OpenAI request parsing and response bodies for `/v1/chat/completions` and `/v1/completions`.

Parsing turns a JSON body into a `GenerationRequest` (an engine prompt plus `SamplingParams`) or raises an
`APIError` (400) that names the field and says what to send instead; nothing reaches the engine before the whole
body is valid. The OpenAI sampling names map through `SamplingParams.from_kwargs` (``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``). Options with no equivalent here
(``n > 1``, tools, logprobs, penalties, ...) are rejected when set to anything but their neutral value; fields this
server does not know are ignored, as OpenAI-compatible servers do. Chat's ``response_format`` (``text``,
``json_object``, ``json_schema``; also vLLM-style ``regex`` / ``grammar``) constrains the output with the engine's
grammar-constrained decoding (`pcr_rag.runtime.grammar`); a schema the grammar library rejects is a 400 naming
``response_format``.

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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pcr_rag.errors import InvalidRequestError
from pcr_rag.requests import ChatPrompt, FlatPrompt, GenerationResult, SamplingParams
from pcr_rag.runtime.grammar import ResponseFormat
from pcr_rag.server.errors import APIError

log = logging.getLogger(__name__)

__all__ = [
    "GenerationRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "parse_chat_request",
    "parse_completion_request",
    "parse_documents",
    "usage_body",
]

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# OpenAI options this server cannot honour, and the value that means "off" (accepted silently).
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
_CHAT_ONLY = ("tools", "functions", "tool_choice", "function_call", "audio", "modalities", "prediction",
              "top_logprobs")
_COMPLETION_ONLY = ("best_of", "echo", "suffix")

_CHAT_FIELDS = frozenset({
    "model", "messages", "documents", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
    "seed", "n", "stream", "stream_options", "response_format", "return_token_ids", *(_NEUTRAL.keys() - set(
        _COMPLETION_ONLY)),
    # accepted and ignored: they change nothing in a local model's answer
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort", "safety_identifier",
    "prompt_cache_key", "verbosity",
})
_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "documents", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
    "stream_options", "return_token_ids", "chat_template", "system", "user", "logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", *_COMPLETION_ONLY,
})


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed, valid request: what to submit to the engine and how to answer."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: ChatPrompt | FlatPrompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


# ------------------------------------------------------------------------------------------------ parsing
def parse_chat_request(body: Any) -> GenerationRequest:
    """A `/v1/chat/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid."""
    body = _object(body)
    _check_unsupported(body, exclude=_COMPLETION_ONLY)
    _ignore_unknown(body, _CHAT_FIELDS, "chat completions")
    response_format = _response_format(body.get("response_format"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError.bad_request("'messages' must be a non-empty list of {'role', 'content'} objects",
                                   param="messages")
    turns = [_chat_turn(i, m) for i, m in enumerate(messages)]
    documents = parse_documents(body.get("documents"))
    max_tokens = _max_tokens(body, "max_tokens", "max_completion_tokens")
    try:
        prompt = ChatPrompt(tuple(turns), documents)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="messages") from None
    return _request("chat", body, prompt, max_tokens, response_format)


def parse_completion_request(body: Any) -> GenerationRequest:
    """A `/v1/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid."""
    body = _object(body)
    _check_unsupported(body, exclude=_CHAT_ONLY)
    _ignore_unknown(body, _COMPLETION_FIELDS, "completions")
    prompt_text = body.get("prompt")
    if isinstance(prompt_text, list) and len(prompt_text) == 1 and isinstance(prompt_text[0], str):
        prompt_text = prompt_text[0]
    if isinstance(prompt_text, list):
        raise APIError.bad_request("'prompt' must be one string: send one request per prompt (token-id prompts "
                                   "are not supported)", param="prompt")
    if not isinstance(prompt_text, str):
        raise APIError.bad_request("'prompt' is required and must be a string", param="prompt")
    chat = _bool(body, "chat_template", False)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise APIError.bad_request("'system' must be a string", param="system")
    if system is not None and not chat:
        raise APIError.bad_request("'system' needs 'chat_template': true (a raw prompt has no system turn); "
                                   "put the system text into the prompt instead", param="system")
    documents = parse_documents(body.get("documents"))
    max_tokens = _max_tokens(body, "max_tokens")
    try:
        prompt = FlatPrompt(prompt_text, documents, chat, system)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="prompt") from None
    return _request("completion", body, prompt, max_tokens)


def parse_documents(value: Any) -> tuple[str, ...]:
    """The ``documents`` extension: absent/null -> (); else a list of strings (400 otherwise)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise APIError.bad_request(f"'documents' must be a list of strings, got {_json_type(value)}",
                                   param="documents")
    for i, doc in enumerate(value):
        if not isinstance(doc, str):
            raise APIError.bad_request(f"documents[{i}] is {_json_type(doc)}, not a string; send each document's "
                                       f"text", param="documents")
    return tuple(value)


def _request(kind: Literal["chat", "completion"], body: dict[str, Any], prompt: ChatPrompt | FlatPrompt,
             max_tokens: int | None, response_format: ResponseFormat | None = None) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError.bad_request("'model' is required: send the id GET /v1/models lists", param="model")
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError.bad_request(f"n={n!r} is not supported: this server returns one choice per request; send "
                                   f"{n} requests (with different seeds when sampling)", param="n")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError.bad_request("'stream_options' is only allowed with 'stream': true",
                                       param="stream_options")
        if not isinstance(options, dict):
            raise APIError.bad_request("'stream_options' must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", False, param="stream_options.include_usage")
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, params=_sampling(body, max_tokens, response_format), stream=stream,
        include_usage=include_usage, return_token_ids=_bool(body, "return_token_ids", False),
    )


def _sampling(body: dict[str, Any], max_tokens: int | None,
              response_format: ResponseFormat | None = None) -> SamplingParams:
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        raise APIError.bad_request(f"'temperature' must be a number in [0, 2], got {temperature!r}",
                                   param="temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise APIError.bad_request(f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError.bad_request("'stop' must be a string or a list of strings", param="stop")
    if isinstance(stop, list):
        stop = [s for s in stop if s]
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise APIError.bad_request(f"'seed' must be an integer, got {seed!r}", param="seed")
    try:
        return SamplingParams.from_kwargs(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          stop=stop or None, seed=seed, response_format=response_format)
    except InvalidRequestError as exc:  # pragma: no cover - the checks above come first
        raise APIError.bad_request(str(exc)) from None


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    values = {name: body.get(name) for name in names if body.get(name) is not None}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise APIError.bad_request(f"'{name}' must be an integer >= 1, got {value!r}", param=name)
    if len(set(values.values())) > 1:
        raise APIError.bad_request(f"{' and '.join(values)} disagree ({values}); send one of them",
                                   param=names[0])
    return next(iter(values.values()), None)


def _chat_turn(i: int, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise APIError.bad_request(f"messages[{i}] must be an object with 'role' and 'content'",
                                   param=f"messages[{i}]")
    role = message.get("role")
    if role in ("tool", "function"):
        raise APIError.bad_request(f"messages[{i}] has role {role!r}: tool calling is not supported; send the "
                                   f"tool's output as a user message", param=f"messages[{i}].role")
    if role not in _CHAT_ROLES:
        raise APIError.bad_request(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}, got {role!r}",
                                   param=f"messages[{i}].role")
    if message.get("tool_calls"):
        raise APIError.bad_request(f"messages[{i}] holds tool_calls: tool calling is not supported",
                                   param=f"messages[{i}].tool_calls")
    return {"role": _CHAT_ROLES[role], "content": _content_text(i, message.get("content"))}


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise APIError.bad_request(f"messages[{i}].content holds a {kind!r} part: only text parts are "
                                           f"supported", param=f"messages[{i}].content")
        return "".join(parts)
    raise APIError.bad_request(f"messages[{i}].content must be a string or a list of text parts, got "
                               f"{_json_type(content)}", param=f"messages[{i}].content")


def _check_unsupported(body: dict[str, Any], exclude: tuple[str, ...]) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in exclude or name not in body:
            continue
        if body[name] not in neutral:
            raise APIError.bad_request(f"{name}={body[name]!r}: {_WHAT_TO_DO[name]}", param=name)


def _response_format(fmt: Any) -> ResponseFormat | None:
    """Chat's ``response_format`` -> the engine's `ResponseFormat` (None: free text); a 400 on what the grammar
    library rejects, before any compute."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise APIError.bad_request("'response_format' must be an object such as {'type': 'json_object'} or "
                                   "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                                   param="response_format")
    try:
        return ResponseFormat.of(fmt)
    except InvalidRequestError as exc:
        raise APIError.bad_request(f"response_format: {exc}", param="response_format") from None


def _ignore_unknown(body: dict[str, Any], known: frozenset[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        log.debug("%s: ignoring unknown fields %s", endpoint, unknown)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError.bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def _bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError.bad_request(f"'{name}' must be true or false, got {value!r}", param=param or name)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
