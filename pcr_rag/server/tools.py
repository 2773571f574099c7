"""Tool calls on the OpenAI wire: a finished answer as a message (`answer_message`) and a streamed answer as deltas
(`ToolCallStream`).

The answer's text is what the grammar allowed (`pcr_rag.structured`): one call object ``{"name": ..., "arguments":
{...}}`` (several, one per line, with ``parallel_tool_calls``) or, under ``tool_choice="auto"``, plain text. Each
call becomes an entry of OpenAI's ``tool_calls`` (``content`` null, ``finish_reason`` "tool_calls") whose
``arguments`` is the arguments' JSON text exactly as the model wrote it, so the argument deltas of a stream (each
call's under its own ``index``) concatenate to the non-streamed ``arguments``. A call cut short (``max_tokens``
or a stop string) is no call: a finished answer returns its text as ``content`` with the engine's finish reason; a
stream that already sent the call's first delta ends with that finish reason ("length"), as OpenAI's streams do.
A parallel call cut short after complete ones is left out of a finished answer, whose complete calls stand with
the engine's finish reason ("length").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcr_rag.structured import (
    CallScan,
    ToolSpec,
    call_key,
    call_spans,
    calls_cut,
    new_call_id,
    parse_tool_calls,
    scan_tool_call,
)

__all__ = ["AnswerMessage", "ToolCallStream", "answer_message"]

TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class AnswerMessage:
    """A finished answer: the message's ``content`` (None when it is a call), its ``tool_calls`` and the choice's
    finish reason."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        return out


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def answer_message(text: str, finish_reason: str, tools: Sequence[ToolSpec]) -> AnswerMessage:
    """The message of a finished answer; without ``tools`` (none bound, or ``tool_choice="none"``) its text."""
    if not tools:
        return AnswerMessage(text, (), finish_reason)
    try:
        parsed = parse_tool_calls(text, tools)
        spans = call_spans(text)
    except ValueError:  # a call cut short: its text, as a plain answer
        return AnswerMessage(text, (), finish_reason)
    calls = []
    for call, (start, end) in zip(parsed, spans):
        scan = scan_tool_call(text[start:end])
        if scan is None or scan.args_start is None or scan.args_end is None:
            return AnswerMessage(text, (), finish_reason)
        calls.append(_call(call.id, call.name, text[start + scan.args_start:start + scan.args_end]))
    if not calls:
        return AnswerMessage(text, (), finish_reason)
    # a call after these cut short: the engine's finish reason ("length")
    return AnswerMessage(None, tuple(calls), finish_reason if calls_cut(text) else TOOL_CALLS)


class ToolCallStream:
    """One choice's streamed deltas with ``tools`` bound: plain text streams as ``content``; an answer that starts
    with ``{`` is a call, held until its name is complete, then sent as a first delta with the call's id, type, name
    and empty arguments, and its arguments' text as it grows (OpenAI's shape). A call that follows a complete one
    (parallel calls) is held until it is complete, then sent under the next ``index`` unless it repeats an earlier
    call exactly (left out, as `pcr_rag.structured.call_spans` leaves it out of a finished answer)."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = tuple(tools)
        self.calling: bool | None = None
        self.text = ""
        self.index = 0          # the call being streamed
        self.start = 0          # where its object starts in `text` (offsets below are from there)
        self.call_id: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.sent_args = 0
        self.seen: set[str] = set()  # `call_key`s of the calls sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for the next piece of text (none while a call's name is incomplete)."""
        if not text:
            return []
        if not self.tools:
            return [{"content": text}]
        if self.calling is None:
            self.calling = text.lstrip().startswith("{")
        if not self.calling:
            return [{"content": text}]
        self.text += text
        return self._call_deltas(text)

    def finish(self, text: str, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the choice's finish reason, given the finished answer's ``text``."""
        if not self.calling:
            return [], finish_reason
        answer = answer_message(text, finish_reason, self.tools)
        if answer.tool_calls:
            return self._call_deltas(), answer.finish_reason
        if self.call_id is None and self.index == 0:  # cut before its name was complete: nothing sent yet, as text
            return [{"content": self.text}] if self.text else [], finish_reason
        return [], finish_reason

    def _call_deltas(self, piece: str = "}") -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            part = self.text[self.start:]
            if self.call_id is not None and self.args_end is None and "}" not in piece:
                scan = CallScan(None, self.args_start)  # the arguments object can only close on a "}": no rescan
            else:
                scan = scan_tool_call(part) or CallScan()
                self.args_start, self.args_end = scan.args_start, scan.args_end
            if self.call_id is None and (scan.name is None or scan.args_start is None):
                return deltas
            if self.call_id is None and self.index > 0:  # a later call: whole, once complete, unless a repeat
                if not scan.complete:
                    return deltas
                offset = part.index("{")
                end = json.JSONDecoder().raw_decode(part, offset)[1]
                key = call_key(part[offset:end])
                self.start += end
                self.args_start = self.args_end = None
                if key in self.seen:
                    continue
                self.seen.add(key)
                assert scan.args_start is not None and scan.args_end is not None
                deltas.append({"tool_calls": [{"index": self.index, **_call(new_call_id(), scan.name or "",
                                                                            "")}]})
                deltas.append({"tool_calls": [{"index": self.index, "function": {
                    "arguments": part[scan.args_start:scan.args_end]}}]})
                self.index += 1
                continue
            if self.call_id is None:
                self.call_id = new_call_id()
                deltas.append({"tool_calls": [{"index": self.index, **_call(self.call_id, scan.name or "", "")}]})
            assert self.args_start is not None
            end = self.args_end if self.args_end is not None else len(part)
            fresh = part[self.args_start + self.sent_args:end]
            if fresh:
                self.sent_args += len(fresh)
                deltas.append({"tool_calls": [{"index": self.index, "function": {"arguments": fresh}}]})
            if not scan.complete:
                return deltas
            # this call's object is closed: what follows (a newline, then "{") is the next call
            offset = part.index("{")
            end = json.JSONDecoder().raw_decode(part, offset)[1]
            self.seen.add(call_key(part[offset:end]))
            self.start += end
            self.index += 1
            self.call_id, self.args_start, self.args_end, self.sent_args = None, None, None, 0
