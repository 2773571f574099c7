"""The generation routes' request flow (`/v1/chat/completions`, `/v1/completions`), after the route read the body.

The route submits on a request thread (`ServerState.off_loop`, never on the event loop): it parses the body
(`pcr_rag.server.schemas`), translates it (`pcr_rag.server.translate`) and `ServerState.submit` submits one engine
request per choice; a submit whose client is gone before it returned is cancelled (`abandon`). `respond` tracks
the handles (`ServerState.track`) until the response ends; the answer is either an SSE stream of chunks
(`stream_events`; a failure mid-stream is an error event, then ``[DONE]``) or, once every choice finished, one JSON
body built and encoded on a request thread (n choices of long answers with top logprobs are megabytes of JSON). A
client that disconnects cancels its requests (stream or not; counted as 499). With tools bound, each choice's answer
becomes a message or a stream of deltas through `pcr_rag.server.tools`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pcr_rag.errors import EngineClosedError, RequestCancelledError
from pcr_rag.handle import RequestHandle
from pcr_rag.request import GenerationResult, StreamChunk
from pcr_rag.server.disclosure import disclose
from pcr_rag.server.errors import APIError, internal_error
from pcr_rag.server.schemas import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_body,
)
from pcr_rag.server.state import ServerState
from pcr_rag.server.streaming import DONE, LogprobBuffer, SSEResponse, sse
from pcr_rag.server.tools import ToolCallStream, answer_message
from pcr_rag.server.translate import GenerationRequest

__all__ = ["abandon", "merge_streams", "respond", "results_or_disconnect"]


def abandon(prepared: tuple[GenerationRequest, list[RequestHandle]]) -> None:
    """Cancel the requests of a submit whose client went away before it returned (`ServerState.off_loop`'s
    ``orphan``)."""
    for handle in prepared[1]:
        handle.close()


async def respond(request: Request, state: ServerState, req: GenerationRequest,
                  handles: list[RequestHandle]) -> Response:
    """The answer to a submitted generation request (``handles``: one per choice, `ServerState.submit`): tracked
    until it ends, then streamed or, once every choice finished, one JSON body."""
    state.track(handles)
    rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if req.stream:
        return disclose(SSEResponse(stream_events(state, handles, req, rid, created),
                                    on_close=lambda: state.finished(handles)), req.ignored, request.url.path)
    try:
        results = await results_or_disconnect(request, handles)
    except Exception as exc:  # noqa: BLE001 - failed or cancelled while running
        raise _failure(exc) from None
    finally:
        state.finished(handles)
    for result in results:
        state.observe(result)

    def encode() -> bytes:  # n choices of long answers with top logprobs are megabytes of JSON
        if req.kind == "chat":
            answers = [answer_message(r.text, r.finish_reason, req.tools) for r in results]
            body = chat_response(rid, created, state.model_name, results, req.return_token_ids, answers)
        else:
            body = completion_response(rid, created, state.model_name, results, req.return_token_ids)
        return _json_bytes(body)

    return disclose(Response(await state.off_loop(encode), media_type="application/json"), req.ignored,
                    request.url.path)


async def stream_events(state: ServerState, handles: list[RequestHandle], req: GenerationRequest, rid: str,
                        created: int) -> AsyncIterator[bytes]:
    """The SSE events of a streamed answer: (chat) each choice's role, then each choice's pieces as they come, its
    final chunk, the usage chunk when asked for, and ``[DONE]``."""
    model = state.model_name
    chat = req.kind == "chat"
    usage_field = {"usage": None} if req.include_usage else {}
    calls = [ToolCallStream(req.tools) for _ in handles]
    logprobs = [LogprobBuffer(req.kind) for _ in handles]  # each token's logprob goes with the next chunk sent

    def chunk(index: int, text: str, finish: str | None = None, token_ids: list[int] | None = None,
              delta: dict[str, Any] | None = None) -> bytes:
        lp = logprobs[index].take()
        if chat:
            body = chat_chunk(rid, created, model, delta if delta is not None else {"content": text}, finish,
                              token_ids, index=index, logprobs=lp)
        else:
            body = completion_chunk(rid, created, model, text, finish, token_ids, index=index, logprobs=lp)
        return sse({**body, **usage_field})

    if chat:
        for index in range(len(handles)):
            yield chunk(index, "", delta={"role": "assistant", "content": ""})
    results: list[GenerationResult | None] = [None] * len(handles)
    try:
        async for index, piece in merge_streams(handles):
            if piece.is_final:
                result = results[index] = piece.result
                state.observe(result)
                if not chat:
                    yield chunk(index, "", finish=result.finish_reason)
                    continue
                deltas, finish = calls[index].finish(result.text, result.finish_reason)
                for delta in deltas:
                    yield chunk(index, "", delta=delta)
                yield chunk(index, "", finish=finish, delta={})
                continue
            token_ids = [piece.token_id] if req.return_token_ids else None
            logprobs[index].add(piece.logprobs)
            if not chat:
                if piece.text or token_ids:
                    yield chunk(index, piece.text, token_ids=token_ids)
                continue
            deltas = calls[index].feed(piece.text)
            if not deltas and token_ids:  # one chunk per token: a held call's token gets an empty delta
                deltas = [{} if calls[index].calling else {"content": ""}]
            for i, delta in enumerate(deltas):
                yield chunk(index, "", delta=delta, token_ids=token_ids if i == 0 else None)
    except Exception as exc:  # noqa: BLE001 - a request failed mid-stream: say so in the stream
        error = _failure(exc)
        state.metrics.count_error(error.status)
        yield sse(error.body())
        yield DONE
        return
    done = [r for r in results if r is not None]
    assert len(done) == len(handles)
    if req.include_usage:
        tail: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": model, "choices": [],
                                "usage": usage_body(done)}
        if req.return_token_ids:  # both endpoints: a client's streamed result has its prompt's ids too
            tail["prompt_token_ids"] = list(done[0].prompt_token_ids)
        yield sse(tail)
    yield DONE


async def results_or_disconnect(request: Request, handles: list[RequestHandle]) -> list[GenerationResult]:
    """The handles' results, in order; cancels the requests (and raises a 499 `APIError`) when the client
    disconnects first. The first failure raises; the caller's `ServerState.finished` cancels the others."""
    results = asyncio.ensure_future(asyncio.gather(*(handle.aresult() for handle in handles)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, results):
            if not task.done():
                task.cancel()  # aresult cancels the engine request
        for task in (gone, results):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if results not in done:
        for handle in handles:
            handle.cancel()
        raise APIError.client_closed()
    return list(results.result())


async def merge_streams(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Every handle's pieces as they come, tagged with the handle's index, up to each one's final piece; a failed
    request raises here. One handle is iterated directly; several by a task each, cancelled (which cancels their
    engine requests) when the consumer stops or is cancelled."""
    if len(handles) == 1:
        async for piece in handles[0]:
            yield 0, piece
            if piece.is_final:
                return
        raise RuntimeError("the request's stream ended without its result")
    queue: asyncio.Queue[tuple[int, StreamChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for piece in handle:
                queue.put_nowait((index, piece, None))
                if piece.is_final:
                    return
            raise RuntimeError("the request's stream ended without its result")
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which answers it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            assert piece is not None
            yield index, piece
            remaining -= piece.is_final
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _failure(exc: BaseException) -> APIError:
    """The API error for a request that failed after it was accepted."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClosedError):
        return APIError.unavailable("the server shut down before this request finished; retry")
    if isinstance(exc, RequestCancelledError):
        return APIError(503, f"the request was cancelled ({exc}); retry", type="server_error", code="cancelled")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc), type="server_error", code="timeout")
    return internal_error(exc, "request failed")


def _json_bytes(body: Any) -> bytes:
    """``body`` as `JSONResponse` encodes it (compact UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
