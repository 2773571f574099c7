"""The wire side of `pcr_rag.client.http`: what an `HTTPEngine` request sends (`wire_documents`,
`sampling_arguments`, `reuse_argument`), how an answer becomes `StreamChunk`s and a `GenerationResult` (`ResponseDecoder`), and which
project error a failed call raises (`remote_error`). Pure functions of dicts and exceptions, no I/O."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from pcr_rag.errors import (
    InvalidRequestError,
    PCRError,
    PromptTooLongError,
    QueueFullError,
    RequestCancelledError,
)
from pcr_rag.metrics import REUSE_MODES, TIERS, RequestMetrics
from pcr_rag.request import GenerationResult, SamplingParams, StreamChunk, TokenLogprob, TopLogprob

__all__ = ["DeadlinePassed", "RemoteAuthError", "RemoteEngineError", "RemotePromptTooLongError", "ResponseDecoder",
           "remote_error", "reuse_argument", "sampling_arguments", "unreachable", "wire_documents"]


# SamplingParams fields sent under their own (OpenAI) name as SDK arguments, and vLLM's extensions (extra_body)
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
_VLLM_NAMES = ("top_k", "repetition_penalty", "min_p", "min_tokens", "ignore_eos")


class RemoteEngineError(PCRError):
    """The server could not be reached or failed (5xx, broken stream); check that `pcr-rag serve` runs there."""


class RemoteAuthError(RemoteEngineError):
    """The server refused the API key (401): pass the key it was started with (``api_key=``)."""


class RemotePromptTooLongError(PromptTooLongError):
    """The server refused the prompt as too long for its ``max_model_len`` (400 ``context_length_exceeded``); the
    message is the server's. The token counts are not known here (None)."""

    def __init__(self, message: str) -> None:
        InvalidRequestError.__init__(self, message)
        self.prompt_tokens = self.max_new_tokens = self.context_window = self.excess_tokens = None  # type: ignore[assignment]


class DeadlinePassed(openai.OpenAIError):
    """An attempt (a retry) would start after the caller's deadline; an `openai.OpenAIError`, which the SDK raises
    instead of retrying."""


# ------------------------------------------------------------------------------------------------ requests
def wire_documents(texts: Sequence[str], scopes: Sequence[str | None] = ()) -> list[str | dict[str, Any]]:
    """Documents as the server takes them: the text, or ``{"text", "scope"}`` for one with a sharing scope."""
    scopes = tuple(scopes) or (None,) * len(texts)
    return [text if scope is None else {"text": text, "scope": scope} for text, scope in zip(texts, scopes)]


def reuse_argument(reuse: str | None) -> str | None:
    """``reuse`` checked as `PCREngine.submit` checks it ("exact", "blend", or None: the server's default), so a bad
    mode raises `InvalidRequestError` here, before any call, as it does locally.

    Raises:
        InvalidRequestError: any other value.
    """
    if reuse is not None and reuse not in REUSE_MODES:
        raise InvalidRequestError(f"reuse must be one of {REUSE_MODES} or None, got {reuse!r}")
    return reuse


def sampling_arguments(params: SamplingParams, chat: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """``params`` as ``create`` keyword arguments (OpenAI names); vLLM's extensions go into ``extra`` (the
    request's ``extra_body``). Only fields that differ from their default travel (temperature and top_p always).

    Raises:
        InvalidRequestError: a field this client does not know how to send (never dropped silently).
    """
    out: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
    for f in dataclasses.fields(params):
        name, value = f.name, getattr(params, f.name)
        if name in ("temperature", "top_p") or value == f.default:
            continue
        if name in _OPENAI_NAMES:
            out[_OPENAI_NAMES[name]] = value
        elif name == "stop":
            out["stop"] = list(value)
        elif name in _VLLM_NAMES:
            extra[name] = value
        elif name == "response_format":
            (out if chat else extra)["response_format"] = value.to_openai()
        elif name in ("logprobs", "top_logprobs"):
            out.update(_logprobs(params, chat))
        else:
            raise InvalidRequestError(f"SamplingParams.{name}={value!r} cannot be sent to a pcr-rag server by this "
                                      f"client; leave it at its default for a remote engine")
    return out


def _logprobs(params: SamplingParams, chat: bool) -> dict[str, Any]:
    """OpenAI's logprobs fields: chat takes ``logprobs: bool`` + ``top_logprobs: int``, completions
    ``logprobs: int`` (the number of alternatives, 0 = the sampled token's only)."""
    if not params.logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": params.top_logprobs} if chat else {"logprobs": params.top_logprobs}


# ------------------------------------------------------------------------------------------------ decoding
@dataclass
class ResponseDecoder:
    """OpenAI response bodies and stream chunks (as dicts, with the server's extensions) -> `StreamChunk`s and a
    result."""

    chat: bool
    request_id: str = ""
    index: int = 0
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None

    def feed(self, event: dict[str, Any]) -> list[StreamChunk]:
        self.request_id = event.get("id", self.request_id)
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("prompt_token_ids"):
            self.prompt_token_ids = list(event["prompt_token_ids"])
        out: list[StreamChunk] = []
        for choice in event.get("choices") or ():
            if choice.get("prompt_token_ids"):
                self.prompt_token_ids = list(choice["prompt_token_ids"])
            text = ((choice.get("delta") or {}).get("content") if self.chat else choice.get("text")) or ""
            ids = list(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if not ids and text:  # a server without return_token_ids: text only
                ids = [-2]
            logprobs = self._logprobs(choice, ids)
            for j, token_id in enumerate(ids):
                piece = text if j == 0 else ""
                out.append(StreamChunk(token_id, piece, self.index, logprobs=logprobs[j] if logprobs else None))
                self.index += 1
                self.pieces.append(piece)
                if token_id >= 0:
                    self.token_ids.append(token_id)
        return out

    def finish(self) -> GenerationResult:
        if self.usage is None:
            raise RemoteEngineError("the server's stream ended without its usage chunk; is it a pcr-rag server?")
        return self._result("".join(self.pieces))

    def whole(self, data: dict[str, Any]) -> GenerationResult:
        """A non-streamed response body -> result."""
        self.request_id = data.get("id", "")
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
        self.token_ids = list(choice.get("token_ids") or ())
        self.prompt_token_ids = list(data.get("prompt_token_ids") or choice.get("prompt_token_ids") or ())
        self.finish_reason = choice.get("finish_reason") or "stop"
        self.usage = data.get("usage") or {}
        self._logprobs(choice, self.token_ids)
        return self._result(text or "")

    def _logprobs(self, choice: dict[str, Any], ids: list[int]) -> list[TokenLogprob] | None:
        """The choice's logprobs (OpenAI's chat ``content`` list, or the completions endpoint's parallel lists),
        one `TokenLogprob` per token of ``ids``; kept for the result. An alternative's id is -1 unless the server
        sends ``token_id``; the legacy shape has no bytes (the token text's UTF-8 stands in)."""
        lp = choice.get("logprobs")
        if not lp:
            return None
        if "content" in lp:  # chat: [{"token", "logprob", "bytes", "top_logprobs": [{...}]}]
            rows = [(e, e.get("top_logprobs") or ()) for e in lp["content"] or ()]
        else:  # completions: parallel lists, each position's alternatives as {token: logprob}
            tokens = lp.get("tokens") or []
            tops = lp.get("top_logprobs") or [None] * len(tokens)
            rows = [({"token": t, "logprob": v}, [{"token": k, "logprob": x} for k, x in (top or {}).items()])
                    for t, v, top in zip(tokens, lp.get("token_logprobs") or (), tops)]
        out = [TokenLogprob(token_id, e["token"], _bytes(e), float(e["logprob"]),
                            tuple(TopLogprob(t.get("token_id", -1), t["token"], _bytes(t), float(t["logprob"]))
                                  for t in top))
               for token_id, (e, top) in zip(ids, rows)]
        self.logprobs = (self.logprobs or []) + out
        return out

    def _result(self, text: str) -> GenerationResult:
        usage = self.usage or {}
        pcr = usage.get("pcr") or {}
        reused = dict.fromkeys(TIERS, 0)
        reused.update({k: int(v) for k, v in (pcr.get("reused_by_tier") or {}).items()})
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        blended = int(details.get("blended_tokens") or pcr.get("blended_tokens") or 0)
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        metrics = RequestMetrics(
            ttft_s=float(pcr.get("ttft_s", 0.0)), e2e_s=float(pcr.get("e2e_s", 0.0)),
            queue_s=float(pcr.get("queue_s", 0.0)), prefill_s=float(pcr.get("prefill_s", 0.0)),
            prefill_compute_s=float(pcr.get("prefill_compute_s", 0.0)),
            load_wait_s=float(pcr.get("load_wait_s", 0.0)),
            prompt_tokens=prompt_tokens,
            computed_tokens=int(pcr.get("computed_tokens", prompt_tokens - cached - blended)),
            reused_tokens=cached, reused_by_tier=reused, blended_tokens=blended,
            reuse=str(pcr.get("reuse") or ("blend" if blended else "exact")),
            generated_tokens=int(usage.get("completion_tokens") or len(self.token_ids)),
            prefetch_hit_chunks=int(pcr.get("prefetch_hit_chunks", 0)),
            announced=bool(pcr.get("announcement_claimed", False)),
        )
        return GenerationResult(text=text, token_ids=list(self.token_ids), prompt_token_ids=list(self.prompt_token_ids),
                                metrics=metrics, finish_reason=self.finish_reason,
                                documents_found=int(pcr.get("documents_found", 0)), logprobs=self.logprobs)


def _bytes(entry: dict[str, Any]) -> tuple[int, ...]:
    raw = entry.get("bytes")
    return tuple(raw) if raw is not None else tuple(entry["token"].encode())


# ------------------------------------------------------------------------------------------------ errors
def remote_error(exc: BaseException, base_url: str) -> BaseException:
    """The project's exception for a failed call (the SDK's, httpx's or a malformed answer); see the module
    docstring. A pcr-rag error passes through."""
    if isinstance(exc, PCRError):
        return exc
    if isinstance(exc, (DeadlinePassed, openai.APITimeoutError, httpx.TimeoutException, asyncio.TimeoutError)):
        return TimeoutError(f"the call to {base_url} timed out")
    if isinstance(exc, openai.APIStatusError):
        return _status_error(exc.status_code, exc.body, exc.message)
    if isinstance(exc, openai.APIConnectionError):
        return unreachable(base_url, exc.__cause__ or exc)
    if isinstance(exc, openai.APIError):  # an error event inside a stream
        status = {"cancelled": 499, "service_unavailable": 503}.get(exc.code or "", 500)
        return _status_error(status, exc.body, exc.message)
    if isinstance(exc, httpx.ConnectError):
        return unreachable(base_url, exc)
    if isinstance(exc, (httpx.HTTPError, httpx.StreamError)):
        return RemoteEngineError(f"the stream from {base_url} broke ({type(exc).__name__}: {exc})")
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return RemoteEngineError(f"{base_url} sent a malformed answer ({type(exc).__name__}: {exc}); is it a "
                                 f"pcr-rag server?")
    return exc


def _status_error(status: int, body: object, fallback: str) -> Exception:
    error = body if isinstance(body, dict) else {}
    message = str(error.get("message") or fallback)
    if status in (401, 403):
        return RemoteAuthError(f"the server refused the API key: {message}")
    if status == 400 and error.get("code") == "context_length_exceeded":
        return RemotePromptTooLongError(message)
    if status in (400, 404, 413, 422):
        return InvalidRequestError(message)
    if status == 429:
        return QueueFullError(message)
    if status == 499:
        return RequestCancelledError(message)
    return RemoteEngineError(f"the server answered {status}: {message}")


def unreachable(base_url: str, exc: BaseException) -> RemoteEngineError:
    return RemoteEngineError(f"cannot reach the pcr-rag server at {base_url} ({type(exc).__name__}: {exc}); is "
                             f"`pcr-rag serve` running there?")
