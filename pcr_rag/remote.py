"""`RemoteEngine`: the client side of `pcr-rag serve`, shaped like the `PCREngine` parts the integrations use.

    engine = RemoteEngine("http://127.0.0.1:8000", api_key="...")
    handle = engine.submit(ChatPrompt(messages, documents), SamplingParams(max_new_tokens=64))
    for piece in handle: ...            # or handle.result(), await handle, async for piece in handle
    ticket = engine.announce(documents, query="...")   # a retrieval enters the server's prefetch window

Several app processes (e.g. four uvicorn workers) then share one engine and one KV cache. What it mirrors:
``submit(prompt, params, timeout=) -> RemoteHandle`` (`ChatPrompt` -> ``/v1/chat/completions``, `FlatPrompt` ->
``/v1/completions`` with the ``chat_template``/``system`` extensions; documents travel in the ``documents``
extension), ``announce`` / ``cancel_announcement`` (``/v1/pcr/announce``), ``closed``, ``loaded.name``,
``context_window``, ``config.max_new_tokens``, ``count_tokens`` and ``tokenizer(text)["input_ids"]``
(``/tokenize``). `RemoteHandle` behaves as `RequestHandle`: one stream per handle (sync or async) of
`StreamChunk`s closed by a chunk carrying the `GenerationResult` (text, token ids, finish reason, usage and the
server's per-request metrics), ``result()`` / ``await`` (a non-streamed call when nothing was streamed, so the text
is exactly the engine's), ``cancel()`` (the connection is closed; the server cancels the request and frees its
row), a deadline (``timeout``) on every wait.

Errors: a 400/404/413 answer raises `InvalidRequestError` (so the integrations report it as they do locally), 429
`QueueFullError`, 401 `RemoteAuthError`; an unreachable server, a 5xx or a broken stream raise `RemoteEngineError`;
a passed deadline `TimeoutError`. Needs ``httpx`` only (not the server's dependencies).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pcr_rag.errors import InvalidRequestError, PCRError, QueueFullError, RequestCancelledError
from pcr_rag.metrics import TIERS, RequestMetrics
from pcr_rag.requests import ChatPrompt, FlatPrompt, GenerationResult, Prompt, SamplingParams, StreamChunk

log = logging.getLogger(__name__)

__all__ = ["RemoteAuthError", "RemoteEngine", "RemoteEngineError", "RemoteHandle", "RemoteModelInfo",
           "RemoteTicket"]

DEFAULT_TIMEOUT_S = 600.0      # a whole call, when the caller gives no deadline
CONNECT_TIMEOUT_S = 10.0
ANNOUNCE_TIMEOUT_S = 5.0       # an announcement only buys a prefetch: never hold a retrieval up for long


class RemoteEngineError(PCRError):
    """The server could not be reached or failed (5xx, broken stream); check that `pcr-rag serve` runs there."""


class RemoteAuthError(RemoteEngineError):
    """The server refused the API key (401): pass the key it was started with (``api_key=``)."""


@dataclass(frozen=True)
class RemoteModelInfo:
    """What ``GET /v1/models`` says about the served model (``loaded`` and ``config`` of a `RemoteEngine`)."""

    name: str
    max_model_len: int
    context_window: int
    max_new_tokens: int


@dataclass
class RemoteTicket:
    """An announcement the server holds; ``claimed``/``expired`` as the local `Ticket`'s (set when withdrawn)."""

    ticket_id: int
    documents: tuple[str, ...]
    chunks: int
    claimed: bool = False
    expired: bool = False


class RemoteTokenizer:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` answered by the server's ``/tokenize``."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self._engine.tokenize(text)}


class RemoteEngine:
    """A `PCREngine` look-alike that sends every request to a `pcr-rag serve` server (see the module docstring).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        api_key: the bearer key the server wants (None: no ``Authorization`` header).
        model: the model id to request (None: the first one ``/v1/models`` lists).
        timeout: seconds a call may take when the caller gives no deadline.
        connect_timeout: seconds to wait for a connection.
        transport / async_transport: httpx transports (tests; None = real sockets).
    Thread-safe; usable from any number of threads and event loops.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, connect_timeout: float = CONNECT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None,
                 async_transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, got {base_url!r}")
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ssl = httpx.create_ssl_context() if self.base_url.startswith("https://") else False
        self._async_transport = async_transport
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers, verify=self._ssl,
                                    transport=transport, timeout=self._timeout(None))
        self._info: RemoteModelInfo | None = None
        self._info_lock = threading.Lock()
        self._closed = False
        self.tokenizer = RemoteTokenizer(self)

    # ------------------------------------------------------------------------------------------ properties
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loaded(self) -> RemoteModelInfo:
        """The served model (fetched once from ``/v1/models``)."""
        if self._info is None:
            with self._info_lock:
                if self._info is None:
                    self._info = self._fetch_info()
        return self._info

    @property
    def config(self) -> RemoteModelInfo:
        """The server's defaults a client reads (``max_new_tokens``); the same object as `loaded`."""
        return self.loaded

    @property
    def context_window(self) -> int:
        return self.loaded.context_window

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` under the served model's tokenizer (no special tokens)."""
        body = {"prompt": text, **({"model": self.model} if self.model else {})}
        data = self._call("POST", "/tokenize", body)
        return list(data["tokens"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               timeout: float | None = None) -> RemoteHandle:
        """A handle for ``prompt``; the HTTP call starts when the handle is first iterated or awaited (so it runs
        on the caller's thread or event loop). Raises `InvalidRequestError` for a prompt kind the server has no
        endpoint for (`RagPrompt`) or a bad timeout."""
        self._check_open()
        params = SamplingParams() if params is None else params
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise InvalidRequestError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        return RemoteHandle(self, *self._request_body(prompt, params), timeout=timeout)

    def _request_body(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model or self.loaded.name, "return_token_ids": True}
        if isinstance(prompt, ChatPrompt):
            path = "/v1/chat/completions"
            body["messages"] = [dict(m) for m in prompt.messages]
        elif isinstance(prompt, FlatPrompt):
            path = "/v1/completions"
            body.update(prompt=prompt.text, chat_template=prompt.chat)
            if prompt.system is not None:
                body["system"] = prompt.system
        else:
            raise InvalidRequestError(f"a remote engine takes a ChatPrompt or a FlatPrompt, got "
                                      f"{type(prompt).__name__}; render the prompt first")
        if prompt.documents:
            body["documents"] = list(prompt.documents)
        if params.max_new_tokens is not None:
            body["max_tokens"] = params.max_new_tokens
        body["temperature"] = params.temperature
        body["top_p"] = params.top_p
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.response_format is not None:
            body["response_format"] = params.response_format.to_openai()
        return path, body

    # ------------------------------------------------------------------------------------------ announcements
    def announce(self, documents: Sequence[str], query: str | None = None, *, system: str | None = None,
                 prefix: str | None = None, separator: str | None = None, layout: str = "auto") -> RemoteTicket:
        """``POST /v1/pcr/announce``: the retrieval's request enters the server's prefetch window now."""
        self._check_open()
        docs = tuple(documents)
        body = {"documents": list(docs), "query": query, "system": system, "prefix": prefix,
                "separator": separator, "layout": layout}
        data = self._call("POST", "/v1/pcr/announce", {k: v for k, v in body.items() if v is not None},
                          timeout=ANNOUNCE_TIMEOUT_S)
        return RemoteTicket(int(data["id"]), docs, int(data.get("chunks", 0)))

    def cancel_announcement(self, ticket: RemoteTicket) -> bool:
        """Withdraw an announcement nobody will claim; True if the server still held it."""
        if ticket.claimed or ticket.expired:
            return False
        try:
            data = self._call("DELETE", f"/v1/pcr/announce/{ticket.ticket_id}", None, timeout=ANNOUNCE_TIMEOUT_S)
        except InvalidRequestError:  # 404: claimed or expired on the server meanwhile
            ticket.expired = True
            return False
        ticket.expired = True
        return bool(data.get("withdrawn"))

    # ------------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection pool (the server and its cache are untouched)."""
        self._closed = True
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RemoteEngine {self.base_url} model={self.model!r}>"

    # ------------------------------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RemoteEngineError("this RemoteEngine is closed; create a new one")

    def _timeout(self, seconds: float | None) -> httpx.Timeout:
        total = self.timeout if seconds is None else seconds
        return httpx.Timeout(total, connect=min(self.connect_timeout, total))

    def async_client(self) -> httpx.AsyncClient:
        """A new async client (one per call: an httpx async pool is bound to the event loop that made it)."""
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, verify=self._ssl,
                                 transport=self._async_transport, timeout=self._timeout(None))

    def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None = None) -> Any:
        try:
            response = self._client.request(method, path, json=body, timeout=self._timeout(timeout))
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{method} {self.base_url}{path} timed out: {exc}") from None
        except httpx.HTTPError as exc:
            raise unreachable(self.base_url, exc) from None
        if response.status_code >= 400:
            raise error_from_response(response.status_code, response.content)
        return response.json()

    def _fetch_info(self) -> RemoteModelInfo:
        data = self._call("GET", "/v1/models", None, timeout=self.connect_timeout + 5.0)
        cards = data.get("data") or []
        if not cards:
            raise RemoteEngineError(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == self.model), cards[0]) if self.model else cards[0]
        pcr = card.get("pcr") or {}
        max_len = int(card.get("max_model_len") or pcr.get("context_window") or 0)
        return RemoteModelInfo(name=str(card["id"]), max_model_len=max_len,
                               context_window=int(pcr.get("context_window") or max_len),
                               max_new_tokens=int(pcr.get("max_new_tokens") or 128))


# ------------------------------------------------------------------------------------------------ handle
class RemoteHandle:
    """A submitted remote request; the `RequestHandle` API (see the module docstring)."""

    def __init__(self, engine: RemoteEngine, path: str, body: dict[str, Any], *, timeout: float | None) -> None:
        self._engine = engine
        self._path = path
        self._body = body
        self._chat = path.endswith("/chat/completions")
        self._timeout = timeout
        self._deadline = time.monotonic() + (timeout if timeout is not None else engine.timeout)
        self._decoder = _StreamDecoder(self._chat, body)
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._started = False
        self._cancelled = False
        self._finished_stream = False
        self._sync_events: Iterator[dict[str, Any]] | None = None
        self._sync_response: Any = None
        self._async_events: AsyncIterator[dict[str, Any]] | None = None
        self._pending: list[StreamChunk] = []
        self._lock = threading.Lock()

    @property
    def request_id(self) -> str:
        return self._decoder.request_id

    @property
    def metrics(self) -> RequestMetrics:
        return self._result.metrics if self._result is not None else RequestMetrics()

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    # ------------------------------------------------------------------------------------------ cancel
    def cancel(self) -> bool:
        """Cancel the request: the connection is closed and the server cancels it. True if it had not finished."""
        if self.done():
            return False
        self._cancelled = True
        self._error = RequestCancelledError("request cancelled")
        response = self._sync_response
        if response is not None:
            try:
                response.close()
            except Exception:  # noqa: BLE001 - closing a connection another thread reads from
                pass
        return True

    def close(self) -> None:
        if not self.done():
            self.cancel()
        self._close_sync()

    async def aclose(self) -> None:
        self.close()
        events, self._async_events = self._async_events, None
        if events is not None:
            await events.aclose()  # type: ignore[attr-defined]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------------------------------ result
    def result(self, timeout: float | None = None) -> GenerationResult:
        """The `GenerationResult` (a non-streamed call unless the stream was begun, which is then drained)."""
        if self._result is not None:
            return self._result
        self._raise_if_failed()
        if self._started:
            for _ in self:
                pass
            return self._checked_result()
        self._started = True
        wait = self._wait_s(timeout)
        try:
            response = self._engine._client.post(self._path, json=self._body, timeout=self._engine._timeout(wait))
        except httpx.TimeoutException:
            raise self._timed_out() from None
        except httpx.HTTPError as exc:
            raise self._fail(unreachable(self._engine.base_url, exc)) from None
        if response.status_code >= 400:
            raise self._fail(error_from_response(response.status_code, response.content))
        self._result = self._decoder.whole(response.json())
        return self._result

    async def aresult(self, timeout: float | None = None) -> GenerationResult:
        """`result` for asyncio; cancelling the awaiting task cancels the request."""
        if self._result is not None:
            return self._result
        self._raise_if_failed()
        if self._started:
            async for _ in self:
                pass
            return self._checked_result()
        self._started = True
        try:
            async with self._engine.async_client() as client:
                response = await asyncio.wait_for(client.post(self._path, json=self._body),
                                                  self._wait_s(timeout))
        except (TimeoutError, httpx.TimeoutException):
            raise self._timed_out() from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        except httpx.HTTPError as exc:
            raise self._fail(unreachable(self._engine.base_url, exc)) from None
        if response.status_code >= 400:
            raise self._fail(error_from_response(response.status_code, response.content))
        self._result = self._decoder.whole(response.json())
        return self._result

    def __await__(self):
        return self.aresult().__await__()

    # ------------------------------------------------------------------------------------------ streaming
    def __iter__(self) -> RemoteHandle:
        return self

    def __next__(self) -> StreamChunk:
        if self._finished_stream:
            raise StopIteration
        while not self._pending:
            self._raise_if_failed()
            if self._sync_events is None:
                if self._started:
                    raise RuntimeError("this handle is already consumed (one stream or result per handle)")
                self._started = True
                self._sync_events = self._open_sync()
            if time.monotonic() > self._deadline:
                raise self._timed_out()
            try:
                event = next(self._sync_events)
            except StopIteration:
                return self._closing()
            except httpx.TimeoutException:
                raise self._timed_out() from None
            except httpx.HTTPError as exc:
                if self._cancelled:
                    raise RequestCancelledError("request cancelled") from None
                raise self._fail(self._broken(exc)) from None
            self._pending.extend(self._feed(event))
        return self._pending.pop(0)

    def __aiter__(self) -> RemoteHandle:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._finished_stream:
            raise StopAsyncIteration
        while not self._pending:
            self._raise_if_failed()
            if self._async_events is None:
                if self._started:
                    raise RuntimeError("this handle is already consumed (one stream or result per handle)")
                self._started = True
                self._async_events = self._open_async()
            try:
                event = await asyncio.wait_for(self._async_events.__anext__(),
                                               max(0.0, self._deadline - time.monotonic()))
            except StopAsyncIteration:
                return self._closing()
            except (TimeoutError, httpx.TimeoutException):
                await self.aclose()
                raise self._timed_out() from None
            except asyncio.CancelledError:
                await self.aclose()
                raise
            except httpx.HTTPError as exc:
                raise self._fail(self._broken(exc)) from None
            self._pending.extend(self._feed(event))
        return self._pending.pop(0)

    # ------------------------------------------------------------------------------------------ internals
    def _stream_body(self) -> dict[str, Any]:
        return {**self._body, "stream": True, "stream_options": {"include_usage": True}}

    def _open_sync(self) -> Iterator[dict[str, Any]]:
        client = self._engine._client
        request = client.build_request("POST", self._path, json=self._stream_body(),
                                       timeout=self._engine._timeout(self._wait_s(None)))
        try:
            response = client.send(request, stream=True)
        except httpx.TimeoutException:
            raise self._timed_out() from None
        except httpx.HTTPError as exc:
            raise self._fail(self._broken(exc)) from None
        if response.status_code >= 400:
            content = response.read()
            response.close()
            raise self._fail(error_from_response(response.status_code, content))
        self._sync_response = response
        return _sse_events(response.iter_lines())

    async def _open_async(self) -> AsyncIterator[dict[str, Any]]:
        async with self._engine.async_client() as client, \
                client.stream("POST", self._path, json=self._stream_body()) as response:
            if response.status_code >= 400:
                raise self._fail(error_from_response(response.status_code, await response.aread()))
            async for event in _asse_events(response.aiter_lines()):
                yield event

    def _broken(self, exc: httpx.HTTPError) -> RemoteEngineError:
        if isinstance(exc, httpx.ConnectError):
            return unreachable(self._engine.base_url, exc)
        return RemoteEngineError(f"the stream from {self._engine.base_url} broke ({type(exc).__name__}: {exc})")

    def _feed(self, event: dict[str, Any]) -> list[StreamChunk]:
        try:
            return self._decoder.feed(event)
        except Exception as exc:
            raise self._fail(exc) from None

    def _closing(self) -> StreamChunk:
        self._close_sync()
        self._result = self._decoder.finish()
        self._finished_stream = True
        return StreamChunk(-1, "", self._decoder.index, self._result)

    def _close_sync(self) -> None:
        response, self._sync_response = self._sync_response, None
        self._sync_events = None
        if response is not None:
            response.close()

    def _checked_result(self) -> GenerationResult:
        self._raise_if_failed()
        assert self._result is not None
        return self._result

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException) -> BaseException:
        self._error = exc
        self._close_sync()
        return exc

    def _wait_s(self, timeout: float | None) -> float:
        left = max(0.0, self._deadline - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _timed_out(self) -> TimeoutError:
        self.cancel()
        what = f"within its timeout of {self._timeout:g} s" if self._timeout is not None else "in time"
        exc = TimeoutError(f"remote request did not finish {what}; it was cancelled")
        self._error = exc
        return exc

    def __repr__(self) -> str:
        return f"<RemoteHandle {self._path} done={self.done()}>"


# ------------------------------------------------------------------------------------------------ decoding
@dataclass
class _StreamDecoder:
    """OpenAI response bodies and stream chunks (with the server's extensions) -> `StreamChunk`s and a result."""

    chat: bool
    body: dict[str, Any]
    request_id: str = ""
    index: int = 0
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, Any] | None = None

    def feed(self, event: dict[str, Any]) -> list[StreamChunk]:
        if "error" in event:
            error = event["error"] or {}
            status = {"cancelled": 499, "service_unavailable": 503}.get(error.get("code") or "", 500)
            raise error_from_response(status, json.dumps(event).encode())
        self.request_id = event.get("id", self.request_id)
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("prompt_token_ids"):
            self.prompt_token_ids = list(event["prompt_token_ids"])
        out: list[StreamChunk] = []
        for choice in event.get("choices") or ():
            if choice.get("prompt_token_ids"):
                self.prompt_token_ids = list(choice["prompt_token_ids"])
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            text = text or ""
            ids = list(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if not ids and text:  # a server without return_token_ids: text only
                ids = [-2]
            for j, token_id in enumerate(ids):
                piece = text if j == 0 else ""
                out.append(StreamChunk(token_id, piece, self.index))
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
        return self._result(text or "")

    def _result(self, text: str) -> GenerationResult:
        usage = self.usage or {}
        pcr = usage.get("pcr") or {}
        reused = dict.fromkeys(TIERS, 0)
        reused.update({k: int(v) for k, v in (pcr.get("reused_by_tier") or {}).items()})
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        metrics = RequestMetrics(
            ttft_s=float(pcr.get("ttft_s", 0.0)), e2e_s=float(pcr.get("e2e_s", 0.0)),
            queue_s=float(pcr.get("queue_s", 0.0)), prefill_s=float(pcr.get("prefill_s", 0.0)),
            prefill_compute_s=float(pcr.get("prefill_compute_s", 0.0)),
            load_wait_s=float(pcr.get("load_wait_s", 0.0)),
            prompt_tokens=prompt_tokens, computed_tokens=int(pcr.get("computed_tokens", prompt_tokens - cached)),
            reused_tokens=cached, reused_by_tier=reused,
            generated_tokens=int(usage.get("completion_tokens") or len(self.token_ids)),
            prefetch_hit_chunks=int(pcr.get("prefetch_hit_chunks", 0)),
            announced=bool(pcr.get("announcement_claimed", False)),
        )
        return GenerationResult(text=text, token_ids=list(self.token_ids), prompt_token_ids=list(self.prompt_token_ids),
                                metrics=metrics, finish_reason=self.finish_reason,
                                documents_found=int(pcr.get("documents_found", 0)))


def _parse_sse(line: str) -> dict[str, Any] | None | bool:
    """One SSE line -> an event dict, None (not a data line) or False ([DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return False
    try:
        return json.loads(data)
    except ValueError:
        raise RemoteEngineError(f"the server sent a malformed event: {data[:200]!r}") from None


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        event = _parse_sse(line)
        if event is False:
            return
        if event is not None:
            yield event  # type: ignore[misc]


async def _asse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        event = _parse_sse(line)
        if event is False:
            return
        if event is not None:
            yield event  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ errors
def error_from_response(status: int, content: bytes) -> Exception:
    """The exception for an error answer of the server (OpenAI-shaped body)."""
    try:
        error = json.loads(content).get("error") or {}
        message = str(error.get("message") or content[:500])
    except (ValueError, AttributeError):
        message = content[:500].decode(errors="replace")
    if status == 401:
        return RemoteAuthError(f"the server refused the API key: {message}")
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
