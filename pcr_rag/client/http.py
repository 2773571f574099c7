"""`HTTPEngine`: the client side of `pcr-rag serve`, on the official ``openai`` SDK, shaped like the `PCREngine`
parts the integrations use.

    engine = HTTPEngine("http://127.0.0.1:8000", api_key="...")
    handle = engine.submit(ChatPrompt(messages, documents), SamplingParams(max_new_tokens=64))
    for piece in handle: ...            # or handle.result(), await handle, async for piece in handle
    ticket = engine.announce(documents, query="...")   # or: await engine.aannounce(...) on an event loop

What travels: `ChatPrompt` -> ``client.chat.completions.create``, `FlatPrompt` -> ``client.completions.create``,
`RagPrompt` (a question over documents, laid out by the engine as `PCREngine.generate` lays it out) ->
``client.completions.create`` with ``layout: "rag"`` and its ``system`` and ``system_tail`` (the per-request
instructions placed after the documents), so the server builds the same prompt and gives the same tokens.
Every `SamplingParams` field that differs from its default is sent, by its OpenAI name as an SDK argument
(``max_tokens``, ``stop``, ``seed``, penalties, ``logprobs``) or in ``extra_body`` (vLLM's ``top_k``,
``repetition_penalty``, ``min_p``, ``min_tokens`` and ``ignore_eos``; the completions endpoint's
``response_format``); a field this client cannot
send raises `InvalidRequestError` before any call, so nothing is dropped silently. The server's extensions go in
``extra_body`` too: ``documents`` (each a string, or ``{"text", "scope"}`` when it has a sharing scope, see
`pcr_rag.Doc`), ``return_token_ids``, ``chat_template``, ``system``, a `ChatPrompt`'s
``chat_template_kwargs``, and ``reuse`` when `HTTPEngine.submit` is given one (blend mode; the answer's
``prompt_tokens_details.blended_tokens`` and ``pcr.reuse`` come back as the result's ``metrics.blended_tokens`` and
``metrics.reuse``). The server's own routes (``/v1/pcr/announce``, its ``DELETE``, ``/tokenize``) go through
the SDK client's raw ``post`` / ``delete``; the model card through ``client.models.list()``. A request with documents carries ``X-PCR-Route`` (`pcr_rag.client.routing`: a hash of its first
document and the head before it), so a proxy hashing on it sends it to the replica that holds those documents.

`submit` returns the engine's own `RequestHandle` (`pcr_rag.handle`) over an `HTTPCall`: one stream per handle (sync or async) of `StreamChunk`s closed by a
chunk carrying the `GenerationResult` (text, token ids, finish reason, usage, the server's per-request metrics),
``result()`` / ``await`` (a non-streamed call when nothing was streamed, so the text is exactly the engine's),
``cancel()`` (the connection is closed; the server cancels the request and frees its row), a deadline
(``timeout``) on every wait.

Retries are the SDK's (``max_retries``, exponential backoff, ``Retry-After``): a connection error, 408, 429 (queue
full) and 5xx (a draining server's 503) are retried; no attempt starts after the caller's deadline (a request hook
clips each attempt's timeout to it and refuses one that would start later, so a timeout is not retried past it).
Announcements are not retried: they only buy a prefetch, and a late one buys nothing.

Tracing (`pcr_rag.tracing`, when the process traces): every call carries the caller's span as W3C ``traceparent``
(an httpx request hook, retries included), so the server's spans join the caller's trace; an announcement runs in a
``pcr_rag.announce`` CLIENT span of its own.

Errors once retries are spent: 400 ``context_length_exceeded`` `RemotePromptTooLongError` (a
`PromptTooLongError`), other 400/404/413/422 `InvalidRequestError` (so the integrations report them as they do
locally), 429 `QueueFullError`, 401/403 `RemoteAuthError`, 499 or a cancelled stream `RequestCancelledError`; an
unreachable server, a 5xx or a broken stream `RemoteEngineError`; a passed deadline `TimeoutError`.

The wire format (arguments, answers, errors) lives in `pcr_rag.client.wire`. Async clients: one
`openai.AsyncOpenAI` per call (`HTTPEngine.async_client`), because an httpx async pool is bound
to the event loop that made it and an `HTTPEngine` serves any number of threads and loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI, OpenAI

from pcr_rag import tracing
from pcr_rag.client.routing import ROUTE_HEADER, prompt_route, routing_key
from pcr_rag.client.wire import (
    DeadlinePassed,
    RemoteAuthError,
    RemoteEngineError,
    RemotePromptTooLongError,
    ResponseDecoder,
    remote_error,
    reuse_argument,
    sampling_arguments,
    wire_documents,
)
from pcr_rag.errors import InvalidRequestError, PCRError, RequestCancelledError
from pcr_rag.handle import RequestHandle, RequestState
from pcr_rag.metrics import RequestMetrics
from pcr_rag.prompt import Doc, split_documents
from pcr_rag.request import (
    ChatPrompt,
    FlatPrompt,
    GenerationResult,
    Prompt,
    RagPrompt,
    SamplingParams,
    StreamChunk,
)

log = logging.getLogger(__name__)

__all__ = ["RemoteAuthError", "HTTPEngine", "RemoteEngineError", "HTTPCall", "RemoteModelInfo",
           "RemotePromptTooLongError", "RemoteTicket"]

DEFAULT_TIMEOUT_S = 600.0      # a whole call, when the caller gives no deadline
CONNECT_TIMEOUT_S = 10.0
ANNOUNCE_TIMEOUT_S = 5.0       # an announcement only buys a prefetch: never hold a retrieval up for long
DEFAULT_MAX_RETRIES = 2        # the SDK's default

# no Authorization without a key (the SDK insists on one otherwise), and never the environment's OpenAI org/project
_NO_KEY_HEADERS = {"Authorization": openai.Omit()}
_PRIVATE_HEADERS = {"OpenAI-Organization": openai.Omit(), "OpenAI-Project": openai.Omit()}


@dataclass(frozen=True)
class RemoteModelInfo:
    """What ``GET /v1/models`` says about the served model (``loaded`` and ``config`` of an `HTTPEngine`)."""

    name: str
    max_model_len: int
    context_window: int
    max_new_tokens: int


@dataclass
class RemoteTicket:
    """An announcement the server holds; ``claimed``/``expired`` as the local `Ticket`'s (set when withdrawn).
    ``ticket_id`` is None while an `HTTPEngine.announce_task` announcement is on its way."""

    ticket_id: int | None
    documents: tuple[str, ...]
    chunks: int
    claimed: bool = False
    expired: bool = False


class RemoteTokenizer:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` answered by the server's ``/tokenize``."""

    def __init__(self, engine: HTTPEngine) -> None:
        self._engine = engine

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self._engine.tokenize(text)}


# ------------------------------------------------------------------------------------------------ deadlines
_DEADLINE: ContextVar[float | None] = ContextVar("pcr_remote_deadline", default=None)


def _clip_to_deadline(request: httpx.Request) -> None:
    """httpx request hook (runs before every attempt, retries included): the attempt's timeouts end at the
    ``_DEADLINE`` of the calling context; none starts after it."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlinePassed("the caller's deadline passed before this attempt could start")
    timeouts = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {k: left if v is None else min(v, left) for k, v in timeouts.items()}


async def _aclip_to_deadline(request: httpx.Request) -> None:
    _clip_to_deadline(request)


def _inject_trace(request: httpx.Request) -> None:
    """httpx request hook: the calling context's span goes along as W3C ``traceparent`` (`pcr_rag.tracing`), so
    the server's spans join the caller's trace (nothing when tracing is off)."""
    tracing.inject(request.headers)


async def _ainject_trace(request: httpx.Request) -> None:
    _inject_trace(request)


@contextlib.contextmanager
def _deadline(at: float) -> Iterator[None]:
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


# ------------------------------------------------------------------------------------------------ engine
class HTTPEngine:
    """A `PCREngine` look-alike that sends every request to a `pcr-rag serve` server (see the module docstring).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        api_key: the bearer key the server wants (None: no ``Authorization`` header; ``$OPENAI_API_KEY`` is never
            read, so an OpenAI key cannot leak to a pcr-rag server).
        model: the model id to request (None: the first one ``/v1/models`` lists).
        timeout: seconds a call may take when the caller gives no deadline.
        connect_timeout: seconds to wait for a connection.
        max_retries: retries of a failed attempt (connection error, 408, 429, 5xx), with the SDK's backoff.
        transport / async_transport: httpx transports (tests, proxies; None = real sockets).
    Thread-safe; usable from any number of threads and event loops.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, connect_timeout: float = CONNECT_TIMEOUT_S,
                 max_retries: int = DEFAULT_MAX_RETRIES, transport: httpx.BaseTransport | None = None,
                 async_transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, got {base_url!r}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.headers: dict[str, Any] = {**_PRIVATE_HEADERS, **({} if api_key else _NO_KEY_HEADERS)}
        self._options: dict[str, Any] = dict(base_url=self.base_url + "/v1", api_key=api_key or "none",
                                             max_retries=max_retries, timeout=self._timeout(None))
        self._async_transport = async_transport
        self._client = OpenAI(**self._options, http_client=openai.DefaultHttpxClient(
            transport=transport, event_hooks={"request": [_clip_to_deadline, _inject_trace]}))
        self._info: RemoteModelInfo | None = None
        self._info_lock = threading.Lock()
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.tokenizer = RemoteTokenizer(self)

    @property
    def client(self) -> OpenAI:
        """The synchronous `openai.OpenAI` client (base URL ``<server>/v1``)."""
        return self._client

    def async_client(self) -> AsyncOpenAI:
        """A new `openai.AsyncOpenAI` for one call on the running loop; close it (``async with``) when done."""
        return AsyncOpenAI(**self._options, http_client=openai.DefaultAsyncHttpxClient(
            transport=self._async_transport, event_hooks={"request": [_aclip_to_deadline, _ainject_trace]}))

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
        return list(self._raw("post", f"{self.base_url}/tokenize", body)["tokens"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               timeout: float | None = None, reuse: str | None = None) -> RequestHandle:
        """A handle for ``prompt``; the HTTP call starts when the handle is first iterated or awaited (so it runs
        on the caller's thread or event loop). ``reuse``: "exact" or "blend" for this request, sent as the body's
        ``reuse`` field (None: not sent, the server's default), as `PCREngine.submit`'s; the result's
        ``metrics.reuse`` and ``metrics.blended_tokens`` are the server's report. ``prompt``: a `ChatPrompt`, a
        `FlatPrompt`, or a `RagPrompt` (the server's ``layout: "rag"``, ``system_tail`` included). Raises
        `InvalidRequestError` for another prompt kind, a sampling field this client cannot send, an unknown reuse
        mode, or a bad timeout."""
        self._check_open()
        params = SamplingParams() if params is None else params
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise InvalidRequestError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        chat, arguments = self.request_arguments(prompt, params, reuse=reuse)
        return RequestHandle(HTTPCall(self, chat, arguments, timeout=timeout),
                             timeout if timeout is not None else self.timeout)

    def request_arguments(self, prompt: Prompt, params: SamplingParams, *,
                          reuse: str | None = None) -> tuple[bool, dict[str, Any]]:
        """(chat endpoint?, the keyword arguments of ``create``) for ``prompt``, ``params`` and ``reuse`` (see
        `submit`)."""
        extra: dict[str, Any] = {"return_token_ids": True}
        if reuse_argument(reuse) is not None:
            extra["reuse"] = reuse
        args: dict[str, Any]
        if isinstance(prompt, ChatPrompt):
            chat, args = True, {"messages": [dict(m) for m in prompt.messages]}
            if prompt.chat_template_kwargs:
                extra["chat_template_kwargs"] = dict(prompt.chat_template_kwargs)
        elif isinstance(prompt, FlatPrompt):
            chat, args = False, {"prompt": prompt.text}
            extra["chat_template"] = prompt.chat
            if prompt.system is not None:
                extra["system"] = prompt.system
        elif isinstance(prompt, RagPrompt):  # the server lays it out, as the local engine's `generate` does
            chat, args = False, {"prompt": prompt.query}
            extra["layout"] = "rag"
            if prompt.system is not None:
                extra["system"] = prompt.system
            if prompt.system_tail is not None:
                extra["system_tail"] = prompt.system_tail
        else:
            raise InvalidRequestError(f"a remote engine takes a ChatPrompt, a FlatPrompt or a RagPrompt, got "
                                      f"{type(prompt).__name__}")
        if prompt.documents:
            extra["documents"] = wire_documents(prompt.documents, prompt.scopes)
        args.update(sampling_arguments(params, chat, extra))
        return chat, {"model": self.model or self.loaded.name, **args, "extra_body": extra,
                      "extra_headers": {**self.headers, **_route(prompt)}}

    # ------------------------------------------------------------------------------------------ announcements
    def _announce_body(self, documents: Sequence[str | Doc], query: str | None, system: str | None,
                       prefix: str | None, separator: str | None, layout: str,
                       scopes: Sequence[str | None] | None,
                       reuse: str | None = None) -> tuple[tuple[str, ...], dict[str, Any]]:
        self._check_open()
        texts, doc_scopes = split_documents(documents, scopes)
        if not texts:
            raise InvalidRequestError("announce needs at least one retrieved document")
        body = {"documents": wire_documents(texts, doc_scopes), "query": query, "system": system,
                "prefix": prefix, "separator": separator, "layout": layout, "reuse": reuse_argument(reuse)}
        return texts, {k: v for k, v in body.items() if v is not None}

    def announce(self, documents: Sequence[str | Doc], query: str | None = None, *, system: str | None = None,
                 prefix: str | None = None, separator: str | None = None, layout: str = "auto",
                 scopes: Sequence[str | None] | None = None, reuse: str | None = None) -> RemoteTicket:
        """``POST /v1/pcr/announce``: the retrieval's request enters the server's prefetch window now. Documents,
        scopes and ``reuse`` as for `PCREngine.announce` (None: the server's default). Blocks its thread up to
        ``ANNOUNCE_TIMEOUT_S``: from a coroutine, await `aannounce` instead."""
        texts, body = self._announce_body(documents, query, system, prefix, separator, layout, scopes, reuse)
        with tracing.announcement_span(len(texts), client=True):
            data = self._raw("post", "/pcr/announce", body, timeout=ANNOUNCE_TIMEOUT_S, max_retries=0)
        return RemoteTicket(int(data["id"]), texts, int(data.get("chunks", 0)))

    async def aannounce(self, documents: Sequence[str | Doc], query: str | None = None, *,
                        system: str | None = None, prefix: str | None = None, separator: str | None = None,
                        layout: str = "auto", scopes: Sequence[str | None] | None = None,
                        reuse: str | None = None) -> RemoteTicket:
        """`announce` for asyncio: the event loop runs on while the server answers."""
        texts, body = self._announce_body(documents, query, system, prefix, separator, layout, scopes, reuse)
        ticket = RemoteTicket(None, texts, 0)
        await self._announce_into(ticket, body)
        return ticket

    def announce_task(self, documents: Sequence[str | Doc], query: str | None = None, *,
                      system: str | None = None, prefix: str | None = None, separator: str | None = None,
                      layout: str = "auto", scopes: Sequence[str | None] | None = None,
                      withdraw_if: Callable[[], bool] | None = None, reuse: str | None = None) -> RemoteTicket:
        """`aannounce` as a task of the running event loop, for synchronous code running on it (a framework's
        event handler): returns at once a ticket whose ``ticket_id`` and ``chunks`` are filled in when the server
        answers. One withdrawn before that (`cancel_announcement`), or whose ``withdraw_if()`` is true then (the
        model call it was for already went out, so the server may never claim it), is withdrawn on the server
        when its id arrives (its prefetched chunks stay cached); a failed one is logged and marked expired (it
        only cost the prefetch).

        Raises:
            RuntimeError: no event loop runs in this thread (call `announce`).
            InvalidRequestError: bad documents or reuse mode (before anything is sent).
        """
        loop = asyncio.get_running_loop()
        texts, body = self._announce_body(documents, query, system, prefix, separator, layout, scopes, reuse)
        ticket = RemoteTicket(None, texts, 0)

        async def run() -> None:
            try:
                await self._announce_into(ticket, body, withdraw_if)
            except Exception as exc:  # noqa: BLE001 - a prefetch lost, never an error of the caller
                ticket.expired = True
                log.warning("announcing %d documents to %s failed: %s", len(texts), self.base_url, exc)

        task = loop.create_task(run())
        self._tasks.add(task)  # the loop holds its tasks weakly
        task.add_done_callback(self._tasks.discard)
        return ticket

    async def _announce_into(self, ticket: RemoteTicket, body: dict[str, Any],
                             withdraw_if: Callable[[], bool] | None = None) -> None:
        with tracing.announcement_span(len(body["documents"]), client=True):
            data = await self._araw("post", "/pcr/announce", body, timeout=ANNOUNCE_TIMEOUT_S, max_retries=0)
        ticket.ticket_id, ticket.chunks = int(data["id"]), int(data.get("chunks", 0))
        if ticket.expired or (withdraw_if is not None and withdraw_if()):  # withdrawn, or too late, on its way
            ticket.expired = True
            with contextlib.suppress(PCRError, TimeoutError):
                await self._araw("delete", f"/pcr/announce/{ticket.ticket_id}", None, timeout=ANNOUNCE_TIMEOUT_S,
                                 max_retries=0)

    def cancel_announcement(self, ticket: RemoteTicket) -> bool:
        """Withdraw an announcement nobody will claim; True if the server still held it (False for one still on
        its way: it is withdrawn when it arrives)."""
        if ticket.claimed or ticket.expired:
            return False
        ticket.expired = True
        if ticket.ticket_id is None:
            return False
        try:
            data = self._raw("delete", f"/pcr/announce/{ticket.ticket_id}", None, timeout=ANNOUNCE_TIMEOUT_S,
                             max_retries=0)
        except InvalidRequestError:  # 404: claimed or expired on the server meanwhile
            return False
        return bool(data.get("withdrawn"))

    # ------------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection pool (the server and its cache are untouched)."""
        self._closed = True
        self._client.close()

    def __enter__(self) -> HTTPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HTTPEngine {self.base_url} model={self.model!r}>"

    # ------------------------------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RemoteEngineError("this HTTPEngine is closed; create a new one")

    def _timeout(self, seconds: float | None) -> httpx.Timeout:
        total = self.timeout if seconds is None else seconds
        return httpx.Timeout(total, connect=min(self.connect_timeout, total))

    def _raw_options(self, timeout: float | None, max_retries: int | None) -> dict[str, Any]:
        options: dict[str, Any] = {"timeout": self._timeout(timeout), "headers": self.headers}
        if max_retries is not None:
            options["max_retries"] = max_retries
        return options

    def _raw(self, method: str, path: str, body: dict[str, Any] | None, *, timeout: float | None = None,
             max_retries: int | None = None) -> Any:
        """A route of the server's own through the SDK's raw request (its retries, its errors), as JSON."""
        try:
            return _raw_call(self._client, method, path, body, self._raw_options(timeout, max_retries)).json()
        except Exception as exc:  # noqa: BLE001 - every failure maps onto the project's errors
            raise remote_error(exc, self.base_url) from None

    async def _araw(self, method: str, path: str, body: dict[str, Any] | None, *, timeout: float | None = None,
                    max_retries: int | None = None) -> Any:
        try:
            async with self.async_client() as client:
                response = await _raw_call(client, method, path, body, self._raw_options(timeout, max_retries))
            return response.json()
        except Exception as exc:  # noqa: BLE001
            raise remote_error(exc, self.base_url) from None

    def _fetch_info(self) -> RemoteModelInfo:
        try:
            page = self._client.models.list(timeout=self._timeout(self.connect_timeout + 5.0),
                                            extra_headers=self.headers)
        except Exception as exc:  # noqa: BLE001
            raise remote_error(exc, self.base_url) from None
        cards: list[dict[str, Any]] = [card.to_dict() for card in page.data]
        if not cards:
            raise RemoteEngineError(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == self.model), cards[0]) if self.model else cards[0]
        pcr = card.get("pcr") or {}
        max_len = int(card.get("max_model_len") or pcr.get("context_window") or 0)
        return RemoteModelInfo(name=str(card["id"]), max_model_len=max_len,
                               context_window=int(pcr.get("context_window") or max_len),
                               max_new_tokens=int(pcr.get("max_new_tokens") or 128))


def _route(prompt: Prompt) -> dict[str, str]:
    """The ``X-PCR-Route`` header of ``prompt`` (`pcr_rag.client.routing`): a rendered prompt's `prompt_route`; a
    `RagPrompt`'s first document after its ``system`` (the server's layout puts the documents in order right after
    the system turn and the fixed instruction; the tail comes after them, so it never changes the route)."""
    if not isinstance(prompt, RagPrompt):
        return prompt_route(prompt)
    if not prompt.documents:
        return {}
    return {ROUTE_HEADER: routing_key(prompt.docs[:1], system=prompt.system)}


def _raw_call(client: OpenAI | AsyncOpenAI, method: str, path: str, body: dict[str, Any] | None,
              options: dict[str, Any]) -> Any:
    """``client.post`` / ``delete`` (``body`` None: no body) of ``path`` -> the `httpx.Response` (or its awaitable)."""
    extra = {} if body is None else {"body": body}
    return getattr(client, method)(path, cast_to=httpx.Response, options=options, **extra)


# ------------------------------------------------------------------------------------------------ handle
class HTTPCall:
    """One call to `pcr-rag serve` as the `pcr_rag.handle.RequestSource` of a `RequestHandle` (see the module
    docstring): nothing is sent until the handle is iterated (a streamed call) or its result is asked for (a
    non-streamed call, so the text is exactly the engine's); one of the two per call. Errors are recorded once (the
    first wins: a cancel stays a cancel) and raised again by every later wait."""

    def __init__(self, engine: HTTPEngine, chat: bool, arguments: dict[str, Any], *,
                 timeout: float | None) -> None:
        self._engine = engine
        self._chat = chat
        self._arguments = arguments
        self._deadline = time.monotonic() + (timeout if timeout is not None else engine.timeout)
        self._decoder = ResponseDecoder(chat)
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._started = False
        self._cancelled = False
        self._stream: openai.Stream[Any] | None = None
        self._astream: openai.AsyncStream[Any] | None = None
        self._aclient: AsyncOpenAI | None = None
        self._pending: deque[StreamChunk] = deque()

    # ------------------------------------------------------------------------------------------ state
    @property
    def request_id(self) -> str:
        return self._decoder.request_id

    @property
    def state(self) -> RequestState:
        if self._result is not None:
            return RequestState.FINISHED
        if self._error is not None:
            return RequestState.CANCELLED if self._cancelled else RequestState.FAILED
        return RequestState.RUNNING if self._started else RequestState.WAITING

    @property
    def metrics(self) -> RequestMetrics:
        return self._result.metrics if self._result is not None else RequestMetrics()

    @property
    def produced(self) -> int:
        return self._decoder.index

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def cancel(self) -> bool:
        """Cancel the request: the connection is closed and the server cancels it. True if it had not finished."""
        if self.done():
            return False
        self._cancelled = True
        self._error = RequestCancelledError("request cancelled")
        self._close_sync()
        return True

    async def aclose(self) -> None:
        self._close_sync()
        stream, client, self._astream, self._aclient = self._astream, self._aclient, None, None
        with contextlib.suppress(Exception):
            if stream is not None:
                await stream.close()
            if client is not None:
                await client.close()

    # ------------------------------------------------------------------------------------------ result
    def result(self, timeout: float | None) -> GenerationResult:
        """The result: a non-streamed call unless the stream was begun, which is then drained."""
        if self._result is not None:
            return self._result
        self._raise_if_failed()
        if self._started:
            while self.next_chunk(timeout) is not None:
                pass
            return self._checked_result()
        self._started = True
        wait = self._wait_s(timeout)
        try:
            with _deadline(time.monotonic() + wait):
                response = self._create(self._engine.client, stream=False, wait=wait)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from None
        self._result = self._decoder.whole(response.to_dict())
        return self._result

    async def aresult(self, timeout: float | None) -> GenerationResult:
        if self._result is not None:
            return self._result
        self._raise_if_failed()
        if self._started:
            while await self.anext_chunk(timeout) is not None:
                pass
            return self._checked_result()
        self._started = True
        wait = self._wait_s(timeout)
        try:
            async with self._engine.async_client() as client:
                with _deadline(time.monotonic() + wait):
                    response = await self._create(client, stream=False, wait=wait)
        except asyncio.CancelledError:
            self.cancel()
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from None
        self._result = self._decoder.whole(response.to_dict())
        return self._result

    # ------------------------------------------------------------------------------------------ streaming
    def next_chunk(self, timeout: float | None) -> StreamChunk | None:
        while not self._pending:
            self._raise_if_failed()
            if self._result is not None:
                return None
            if self._stream is None:
                self._begin_stream()
                try:
                    with _deadline(self._deadline):
                        self._stream = self._create(self._engine.client, stream=True, wait=self._wait_s(timeout))
                except Exception as exc:  # noqa: BLE001
                    raise self._fail(exc) from None
            if time.monotonic() > self._deadline:
                raise self._timed_out()
            try:
                chunk = next(self._stream)
            except StopIteration:
                self._finish()
                return None
            except Exception as exc:  # noqa: BLE001
                raise self._fail(exc) from None
            self._feed(chunk.to_dict())
        return self._pending.popleft()

    async def anext_chunk(self, timeout: float | None) -> StreamChunk | None:
        while not self._pending:
            self._raise_if_failed()
            if self._result is not None:
                return None
            if self._astream is None:
                self._begin_stream()
                self._aclient = self._engine.async_client()
            try:
                if self._astream is None:
                    with _deadline(self._deadline):
                        self._astream = await self._create(self._aclient, stream=True, wait=self._wait_s(timeout))
                chunk = await asyncio.wait_for(self._astream.__anext__(), self._wait_s(timeout))
            except StopAsyncIteration:
                await self.aclose()
                self._finish()
                return None
            except asyncio.CancelledError:
                self.cancel()
                raise
            except Exception as exc:  # noqa: BLE001
                raise self._fail(exc) from None
            self._feed(chunk.to_dict())
        return self._pending.popleft()

    # ------------------------------------------------------------------------------------------ internals
    def _create(self, client: OpenAI | AsyncOpenAI | None, *, stream: bool, wait: float) -> Any:
        assert client is not None
        endpoint: Any = client.chat.completions if self._chat else client.completions
        streaming = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        return endpoint.create(**self._arguments, **streaming, timeout=self._engine._timeout(wait))

    def _begin_stream(self) -> None:
        if self._started:
            raise RuntimeError("this handle is already consumed (one stream or result per handle)")
        self._started = True

    def _feed(self, event: dict[str, Any]) -> None:
        try:
            self._pending.extend(self._decoder.feed(event))
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from None

    def _finish(self) -> None:
        """The stream ended: the decoder's result, or the error the stream carried."""
        self._close_sync()
        try:
            self._result = self._decoder.finish()
        except RemoteEngineError as exc:
            raise self._fail(exc) from None

    def _close_sync(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):  # closing a connection another thread reads from
                stream.close()

    def _checked_result(self) -> GenerationResult:
        self._raise_if_failed()
        assert self._result is not None
        return self._result

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException) -> BaseException:
        """Record the request's error (the first one wins: a cancel stays a cancel) and close its stream; a timeout
        comes back as `TimeoutError` (the handle then cancels the request)."""
        if self._error is None:
            error = remote_error(exc, self._engine.base_url)
            if isinstance(error, TimeoutError):
                return self._timed_out()
            self._error = error
        self._close_sync()
        return self._error

    def _wait_s(self, timeout: float | None) -> float:
        left = max(0.0, self._deadline - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _timed_out(self) -> TimeoutError:
        self._close_sync()
        return TimeoutError("the server did not answer before the deadline")

    def __repr__(self) -> str:
        return f"<HTTPCall {'chat' if self._chat else 'completion'} done={self.done()}>"


def __getattr__(name: str) -> object:
    from pcr_rag._moved import renamed

    return renamed(__name__, name)  # RemoteEngine: the old name of HTTPEngine, else AttributeError
