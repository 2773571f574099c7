"""Server-sent events: the OpenAI chunk stream of one request, and a response that cancels it when the client goes.

`SSEResponse` sends the events of an async iterator while it watches the connection: when the client disconnects
(or the server cancels the request task at shutdown) the iterator's task is cancelled, which cancels the engine
request inside `RequestHandle.__anext__` (its pinned chunks and KV row are freed at the next engine step), and the
iterator's ``finally`` runs. No token is produced for a reader that is gone.

`LogprobBuffer` holds a choice's token logprobs until a chunk is sent: a token whose text is empty (mid-character,
or a tool call's name still incomplete) sends no chunk of its own, so its logprob rides on the next chunk that is
sent, and every token's logprob is sent exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pcr_rag.request import TokenLogprob, chat_logprobs, completion_logprobs

log = logging.getLogger(__name__)

__all__ = ["DONE", "LogprobBuffer", "SSEResponse", "sse"]

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class LogprobBuffer:
    """One choice's logprobs not sent yet. ``take`` empties it into the shape of the endpoint: chat's
    ``{"content": [...], "refusal": null}``, or the legacy completions' parallel lists whose ``text_offset`` goes
    on from the entries taken before (so the offsets equal a non-streamed answer's)."""

    def __init__(self, kind: Literal["chat", "completion"]) -> None:
        self.kind = kind
        self.pending: list[TokenLogprob] = []
        self.offset = 0

    def add(self, entry: TokenLogprob | None) -> None:
        if entry is not None:
            self.pending.append(entry)

    def take(self) -> dict[str, Any] | None:
        """The pending entries as the chunk's ``logprobs`` (None when there are none), and forget them."""
        if not self.pending:
            return None
        entries, self.pending = self.pending, []
        if self.kind == "chat":
            return chat_logprobs(entries)
        out = completion_logprobs(entries, self.offset)
        self.offset += sum(len(e.token) for e in entries)
        return out


class SSEResponse(Response):
    """A ``text/event-stream`` response over ``events``; ``on_close`` runs once when it ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        # no Response.__init__: that renders a body and sets a Content-Length; a stream has neither
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()  # a send that failed: the client is gone
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                log.debug("client disconnected mid-stream; cancelling its request")
        except OSError:
            log.debug("client disconnected while its stream was written")
        finally:
            for task in (pump, watch):
                task.cancel()
            for task in (pump, watch):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
