"""The caller's side of a submitted request: `RequestHandle`, the one handle of both engines (`PCREngine` and
`pcr_rag.client.http.HTTPEngine`), over a `RequestSource` that says where its tokens and result come from:

- `EngineSource`: the local engine's request, its tokens carried from the executor thread by a `TokenChannel`;
- `pcr_rag.client.http.HTTPCall`: one call to `pcr-rag serve` (a streamed call when the handle is iterated, a
  non-streamed one for ``result()`` / ``await``).

The handle owns what a caller sees the same way on both: the deadline over every wait (a passed deadline cancels
the request and raises `TimeoutError`), one stream per handle closed by a chunk carrying the result, cancelling on
``close()`` / a dropped handle / a cancelled awaiting task.

Invariants: a handle's stream yields every generated token once, in order, then one closing chunk that carries
the `GenerationResult` (or raises the request's error); a request whose deadline passes while someone waits on its
handle is cancelled, and the wait raises `TimeoutError`; a cancelled request releases what it holds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from pcr_rag.metrics import RequestMetrics
from pcr_rag.request import GenerationResult, StreamChunk, TokenLogprob

if TYPE_CHECKING:
    from collections.abc import Generator

__all__ = ["EngineSource", "RequestHandle", "RequestSource", "RequestState", "TokenChannel", "TrackedRequest"]


class RequestState(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TrackedRequest(Protocol):
    """What a `RequestHandle` reads of the request it stands for (the engine's `pcr_rag.sched.request_state.Request`)."""

    request_id: int
    state: RequestState
    metrics: RequestMetrics
    future: Future


class TokenChannel:
    """Tokens of one request on their way from the executor thread to one consumer, sync or async.

    The producer calls `put` per token and `close` once the request's future is done; the consumer takes chunks in
    order with `get` (blocking, with a timeout) or `aget` (awaiting). Thread-safe; holds no reference to the
    handle, so dropping the handle lets it be collected while the request still runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chunks: deque[StreamChunk] = deque()
        self._count = 0
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def produced(self) -> int:
        """Token chunks put so far."""
        return self._count

    def put(self, token_id: int, text: str, logprobs: TokenLogprob | None = None) -> None:
        with self._cond:
            self._chunks.append(StreamChunk(token_id, text, self._count, logprobs=logprobs))
            self._count += 1
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    def close(self, _future: object = None) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    def get(self, timeout: float | None) -> StreamChunk | None:
        """The next chunk; None once closed and drained. Raises `TimeoutError` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._chunks or self._closed, timeout):
                raise TimeoutError
            return self._chunks.popleft() if self._chunks else None

    async def aget(self, timeout: float | None) -> StreamChunk | None:
        """As `get`, awaiting instead of blocking."""
        return await self._await(lambda: self._chunks.popleft() if self._chunks else None,
                                 lambda: bool(self._chunks) or self._closed, timeout)

    async def wait_closed(self, timeout: float | None) -> None:
        """Await `close` without taking chunks. Raises `TimeoutError` after ``timeout`` seconds."""
        await self._await(lambda: None, lambda: self._closed, timeout)

    async def _await(self, take: Callable[[], Any], ready: Callable[[], bool], timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                if ready():
                    return take()
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
            left = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait_for(waiter, left)  # TimeoutError / CancelledError propagate


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, waiter in waiters:
        try:
            loop.call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # the consumer's loop is closed: nobody is waiting any more
            pass


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class RequestSource(Protocol):
    """Where a `RequestHandle`'s tokens and result come from. ``timeout`` arguments are seconds a wait may take
    (None: unbounded); a wait that runs out raises `TimeoutError`, and the handle then cancels the request."""

    @property
    def request_id(self) -> int | str: ...

    @property
    def state(self) -> RequestState: ...

    @property
    def metrics(self) -> RequestMetrics: ...

    @property
    def produced(self) -> int:
        """Token chunks handed out so far (the closing chunk's index)."""
        ...

    def done(self) -> bool: ...

    def cancel(self) -> bool:
        """Cancel the request; True if it had not finished."""
        ...

    def next_chunk(self, timeout: float | None) -> StreamChunk | None:
        """The next token chunk; None once the tokens are over (then `result` does not wait)."""
        ...

    async def anext_chunk(self, timeout: float | None) -> StreamChunk | None: ...

    def result(self, timeout: float | None) -> GenerationResult:
        """The result, or the request's error raised."""
        ...

    async def aresult(self, timeout: float | None) -> GenerationResult: ...

    async def aclose(self) -> None:
        """Release what an async consumer held (connections); the request itself is cancelled by the handle."""
        ...


class EngineSource:
    """The local engine's request as a `RequestSource`: tokens from its `TokenChannel`, the result from its
    future; ``cancel`` is the engine's (a waiting request leaves the queue, a running one stops at its next
    forward)."""

    def __init__(self, request: TrackedRequest, channel: TokenChannel, cancel: Callable[[Any], bool]) -> None:
        self.request = request
        self._channel = channel
        self._cancel = cancel

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def state(self) -> RequestState:
        return self.request.state

    @property
    def metrics(self) -> RequestMetrics:
        return self.request.metrics

    @property
    def produced(self) -> int:
        return self._channel.produced

    def done(self) -> bool:
        return self.request.future.done()

    def cancel(self) -> bool:
        return self._cancel(self.request)

    def next_chunk(self, timeout: float | None) -> StreamChunk | None:
        return self._channel.get(timeout)

    async def anext_chunk(self, timeout: float | None) -> StreamChunk | None:
        return await self._channel.aget(timeout)

    def result(self, timeout: float | None) -> GenerationResult:
        return self.request.future.result(timeout=timeout)

    async def aresult(self, timeout: float | None) -> GenerationResult:
        await self._channel.wait_closed(timeout)  # the channel closes only once the future is done
        return self.request.future.result()

    async def aclose(self) -> None:
        return None


class RequestHandle:
    """The caller's side of one submitted request, on either engine.

    - ``result(timeout=None)`` blocks for the `GenerationResult`; ``await handle`` / ``await handle.aresult()``
      awaits it without blocking the event loop.
    - Iterating (``for`` or ``async for``) yields `StreamChunk`s as tokens come, then the closing chunk with the
      result; a failed or cancelled request raises its error instead. There is one stream per handle.
    - ``cancel()`` cancels the request (a waiting one leaves the queue; a running one stops at its next forward
      and releases its pinned chunks; over HTTP the connection closes and the server does the same);
      ``close()`` / ``aclose()`` cancel it unless it finished. Dropping the last reference to an unfinished handle
      cancels its request too.
    - A deadline (``submit(..., timeout=)``) bounds every wait on the handle: when it passes, the request is
      cancelled and the wait raises `TimeoutError`. Cancelling the task that awaits or iterates cancels the
      request.
    """

    def __init__(self, source: RequestSource, timeout: float | None = None) -> None:
        self._source = source
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._finished_stream = False

    # ------------------------------------------------------------------------------------------ state
    @property
    def request_id(self) -> int | str:
        return self._source.request_id

    @property
    def state(self) -> RequestState:
        return self._source.state

    @property
    def metrics(self) -> RequestMetrics:
        """The request's metrics so far (final once it is done)."""
        return self._source.metrics

    def done(self) -> bool:
        """True once the request finished, failed or was cancelled."""
        return self._source.done()

    def cancel(self) -> bool:
        """Cancel the request; True if it had not finished yet (its result then raises `RequestCancelledError`)."""
        return self._source.cancel()

    def close(self) -> None:
        """Stop consuming: cancels the request unless it already finished (no-op then)."""
        if not self.done():
            self.cancel()

    async def aclose(self) -> None:
        self.close()
        await self._source.aclose()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------------------------------ result
    def result(self, timeout: float | None = None) -> GenerationResult:
        """The `GenerationResult`, waiting at most ``timeout`` seconds (and never past the deadline).

        Raises the request's error (e.g. `RequestCancelledError`); on timeout the request is cancelled and
        `TimeoutError` raised."""
        try:
            return self._source.result(self._wait_s(timeout))
        except TimeoutError:
            raise self._timed_out() from None

    async def aresult(self, timeout: float | None = None) -> GenerationResult:
        """`result` for asyncio: awaits without blocking the loop; cancelling the awaiting task cancels the request."""
        try:
            return await self._source.aresult(self._wait_s(timeout))
        except TimeoutError:
            raise self._timed_out() from None
        except asyncio.CancelledError:
            self.cancel()
            raise

    def __await__(self) -> Generator[Any, None, GenerationResult]:
        return self.aresult().__await__()

    # ------------------------------------------------------------------------------------------ streaming
    def __iter__(self) -> RequestHandle:
        return self

    def __next__(self) -> StreamChunk:
        if self._finished_stream:
            raise StopIteration
        try:
            chunk = self._source.next_chunk(self._wait_s(None))
        except TimeoutError:
            raise self._timed_out() from None
        return chunk if chunk is not None else self._closing_chunk()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._finished_stream:
            raise StopAsyncIteration
        try:
            chunk = await self._source.anext_chunk(self._wait_s(None))
        except TimeoutError:
            await self._source.aclose()
            raise self._timed_out() from None
        except asyncio.CancelledError:
            self.cancel()
            await self._source.aclose()
            raise
        except BaseException:
            await self._source.aclose()
            raise
        if chunk is None:
            await self._source.aclose()
            return self._closing_chunk()
        return chunk

    # ------------------------------------------------------------------------------------------ internals
    def _closing_chunk(self) -> StreamChunk:
        self._finished_stream = True
        result = self._source.result(None)  # the tokens are over: the result is there (or its error is raised)
        return StreamChunk(-1, "", self._source.produced, result)

    def _wait_s(self, timeout: float | None) -> float | None:
        """Seconds a wait may take: ``timeout``, capped by what is left of the deadline (>= 0)."""
        if self._deadline is None:
            return timeout
        left = max(0.0, self._deadline - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _timed_out(self) -> TimeoutError:
        self.cancel()
        past = self._deadline is not None and time.monotonic() >= self._deadline
        what = f"within its timeout of {self._timeout:g} s" if past else "within the wait's timeout"
        return TimeoutError(f"request {self.request_id} did not finish {what}; it was cancelled")

    def __repr__(self) -> str:
        return f"<RequestHandle request_id={self.request_id} state={self.state.value}>"
