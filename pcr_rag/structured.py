"""Structured output and tool calls on grammar-constrained decoding, shared by the LangChain and LlamaIndex models.

The tool-call format (what the model writes, what the history shows it, what the grammar enforces): one call is one
JSON object ``{"name": "<tool name>", "arguments": {...}}`` whose arguments match the tool's parameter schema;
with parallel calls allowed (OpenAI's ``parallel_tool_calls``), an answer may hold several (`MAX_PARALLEL_CALLS`
at most), one object per line (as the history shows an assistant turn with several calls).

- `ToolSpec`: a tool as a name, a description and the JSON schema of its arguments.
- `ToolChoice` and `tool_call_format`: ``"any"`` constrains the answer to one call of any tool, a tool's name to a
  call of that tool, ``"auto"`` to either a call or plain text (text that does not start with ``{``), ``"none"``
  leaves the answer unconstrained.
- `tools_instruction` / `schema_instruction`: the system turn that describes the tools (or the schema) and the
  format. `add_instruction` puts it **after** the conversation - after any retrieved documents - so the documents'
  cached KV stays reusable whatever the tools or schema; a template that rejects a late system turn gets the text
  appended to the last message instead.
- `tool_history_turns`: assistant tool calls and tool results of the history as chat turns. When the chat template
  renders ``tool_calls`` and ``tool`` messages itself (`template_renders_tool_calls`), they are passed in the
  Hugging Face message format; otherwise a call is the assistant's content in the format above and a result is a
  user turn ``Result of <tool> (call <id>): <content>``.
- `with_tools`: a conversation prepared for tools (the instruction added, the answer's grammar), the one step the
  LangChain model and the OpenAI-compatible server share so both send the engine the same prompt and grammar.
- `parse_tool_call`: the call in a finished answer, None for plain text; `parse_tool_calls`: every call (several
  under ``parallel``), with `call_spans` the text span of each; `scan_tool_call`: the call's name and the span of
  its arguments' JSON text in a finished or unfinished answer (what a stream sends as argument deltas).

Object schemas are closed (``additionalProperties: false`` where a schema leaves it open), as in OpenAI's strict
mode, so the model cannot invent keys.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pcr_rag.errors import InvalidRequestError
from pcr_rag.response_format import JSON_OPTIONS, ResponseFormat

log = logging.getLogger(__name__)

__all__ = [
    "CallScan",
    "ToolCall",
    "ToolSpec",
    "add_instruction",
    "close_objects",
    "call_key",
    "call_spans",
    "calls_cut",
    "new_call_id",
    "normalize_tool_choice",
    "parse_tool_call",
    "parse_tool_calls",
    "scan_tool_call",
    "schema_instruction",
    "template_renders_tool_calls",
    "tool_call_format",
    "tool_call_text",
    "tool_history_turns",
    "tools_instruction",
    "with_tools",
]

AUTO, ANY, NONE = "auto", "any", "none"
# calls one answer may hold with parallel calls allowed: the grammar ends the answer after this many, so a model
# that would go on calling (rather than end its answer) stops with a complete list instead of being cut mid-call
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolSpec:
    """A tool: ``parameters`` is the JSON schema of its arguments (an object schema)."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequestError(f"a tool needs a non-empty str name, got {self.name!r}")
        if not isinstance(self.parameters, Mapping):
            raise InvalidRequestError(f"tool {self.name!r}: parameters must be a JSON-schema dict")

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI tool dict (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        return cls(fn.get("name", ""), fn.get("description") or "", params)

    def arguments_schema(self) -> dict[str, Any]:
        schema = close_objects(dict(self.parameters))
        schema.setdefault("type", "object")
        return schema


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its arguments and a call id."""

    name: str
    arguments: dict[str, Any]
    id: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------------- schemas
def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema with ``properties`` and no ``additionalProperties`` gets
    ``additionalProperties: false`` (recursively, ``$defs`` included)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and out.get("type", "object") == "object":
        out["additionalProperties"] = False
    return out


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.arguments_schema()},
            "required": ["name", "arguments"], "additionalProperties": False}


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> str:
    """``None``/"auto" -> "auto"; "any"/"required"/True -> "any"; "none"/False -> "none"; a tool name or an OpenAI
    ``{"type": "function", "function": {"name": ...}}`` -> that name. Raises `InvalidRequestError` otherwise."""
    if choice is None or choice == AUTO:
        return AUTO
    if choice is True or choice in (ANY, "required"):
        return ANY
    if choice is False or choice == NONE:
        return NONE
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise InvalidRequestError(f"tool_choice={choice!r} is not 'auto', 'any', 'none' or the name of a bound tool "
                              f"({', '.join(names) or 'no tools bound'})")


def tool_call_format(tools: Sequence[ToolSpec], choice: str, *, parallel: bool = False) -> ResponseFormat | None:
    """The grammar of an answer under ``choice`` (see the module docstring); None for "none". ``parallel``: one
    call or several, one per line (each of any chosen tool)."""
    if choice == NONE or not tools:
        return None
    chosen = [t for t in tools if choice in (ANY, AUTO) or t.name == choice]
    if not chosen:
        raise InvalidRequestError(f"tool_choice={choice!r} names no bound tool")
    calls = [_call_schema(t) for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if choice != AUTO and not parallel:
        return ResponseFormat.json_schema(schema)
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    call = f"%json {json.dumps(schema, ensure_ascii=False)}"
    text = "text: /[^{\\s][\\s\\S]*/\n"
    if not parallel:
        return ResponseFormat("grammar", f"start: call | text\ncall: {call}\n{text}")
    head = "start: calls | text\n" if choice == AUTO else "start: calls\n"
    repeat = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
    return ResponseFormat("grammar", f'{head}calls: call ("\\n" call){repeat}\ncall: {call}\n'
                                     f"{text if choice == AUTO else ''}")


# ---------------------------------------------------------------------------------------------------- prompt text
def tools_instruction(tools: Sequence[ToolSpec], choice: str, *, parallel: bool = False) -> str:
    """The system turn that lists the tools and the call format (``parallel``: several calls, one per line)."""
    lines = ["You can call these tools:"]
    for t in tools:
        desc = f": {t.description.strip()}" if t.description.strip() else ""
        lines.append(f"- {t.name}{desc} Arguments (JSON schema): "
                     f"{json.dumps(t.arguments_schema(), ensure_ascii=False)}")
    lines.append('To call a tool, reply with only a JSON object: {"name": <tool name>, "arguments": {...}}.')
    if parallel and choice != NONE:
        lines.append("To call several tools at once, write one such JSON object per line.")
    if choice == AUTO:
        lines.append("If no tool is needed, or a tool result already answers the question, reply in plain text.")
    elif choice == ANY:
        lines.append("Reply with a tool call.")
    elif choice != NONE:
        lines.append(f"Reply with a call of {choice}.")
    else:
        lines.append("Do not call a tool now; reply in plain text.")
    return "\n".join(lines)


def schema_instruction(schema: Mapping[str, Any]) -> str:
    """The system turn that asks for JSON matching ``schema``."""
    return ("Reply with only a JSON object that matches this JSON schema: "
            f"{json.dumps(schema, ensure_ascii=False)}")


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call in the format the model writes (how the history shows the assistant's earlier calls)."""
    return json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)


def tool_history_turns(role: str, content: str, *, tool_calls: Sequence[ToolCall] = (),
                       tool_name: str | None = None, tool_call_id: str | None = None, error: bool = False,
                       native: bool = False) -> dict[str, Any]:
    """One history message as a chat turn: an assistant turn with ``tool_calls``, or a tool result
    (``role="tool"``). ``native``: the template renders tool calls itself (see the module docstring)."""
    if role == "tool":
        if native:
            turn = {"role": "tool", "content": content}
            if tool_call_id:
                turn["tool_call_id"] = tool_call_id
            if tool_name:
                turn["name"] = tool_name
            return turn
        what = f"Error from {tool_name or 'the tool'}" if error else f"Result of {tool_name or 'the tool'}"
        call = f" (call {tool_call_id})" if tool_call_id else ""
        return {"role": "user", "content": f"{what}{call}: {content}"}
    if not tool_calls:
        return {"role": role, "content": content}
    if native:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls]}
    calls = "\n".join(tool_call_text(c.name, c.arguments) for c in tool_calls)
    return {"role": "assistant", "content": f"{content.strip()}\n{calls}" if content.strip() else calls}


def add_instruction(turns: list[dict[str, Any]], text: str, tokenizer: Any) -> list[dict[str, Any]]:
    """``turns`` plus ``text`` after the last turn: a trailing system turn where the chat template renders one,
    else appended to the last turn's content."""
    if _late_system_ok(tokenizer):
        return [*turns, {"role": "system", "content": text}]
    *head, last = turns
    return [*head, {**last, "content": f"{last['content']}\n\n{text}"}]


def with_tools(turns: list[dict[str, Any]], tools: Sequence[ToolSpec], choice: str,
               tokenizer: Any, *, parallel: bool = False) -> tuple[list[dict[str, Any]], ResponseFormat | None]:
    """``turns`` with the tools' instruction after the conversation (`add_instruction`) and the answer's grammar
    under ``choice`` (`tool_call_format`; None for "none"); ``parallel``: the answer may hold several calls. No
    tools: ``turns`` unchanged and no grammar."""
    if not tools:
        return turns, None
    instruction = tools_instruction(tools, choice, parallel=parallel)
    return add_instruction(turns, instruction, tokenizer), tool_call_format(tools, choice, parallel=parallel)


# ---------------------------------------------------------------------------------------------------- templates
def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str | None:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any template error means "not supported"
        return None
    return text if isinstance(text, str) else None


def template_renders_tool_calls(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders assistant ``tool_calls`` and ``tool`` results itself."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and _renders_tools(id(tokenizer), str(template), tokenizer)


@lru_cache(maxsize=32)
def _renders_tools(_id: int, _template: str, tokenizer: Any) -> bool:
    probe = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_probe", "type": "function",
                              "function": {"name": "probe_tool_x7", "arguments": {"probe_arg": 1}}}]},
             {"role": "tool", "content": "probe_result_y9", "tool_call_id": "call_probe", "name": "probe_tool_x7"}]
    text = _render(tokenizer, probe)
    return text is not None and "probe_tool_x7" in text and "probe_result_y9" in text


def _late_system_ok(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return True  # rendered as "role: content" lines
    return _late_system(id(tokenizer), str(template), tokenizer)


@lru_cache(maxsize=32)
def _late_system(_id: int, _template: str, tokenizer: Any) -> bool:
    text = _render(tokenizer, [{"role": "user", "content": "probe_q"}, {"role": "system", "content": "probe_s"}])
    return text is not None and "probe_s" in text and text.index("probe_s") > text.index("probe_q")


# ---------------------------------------------------------------------------------------------------- parsing
def parse_tool_call(text: str, tools: Sequence[ToolSpec]) -> ToolCall | None:
    """The call in a finished answer (a fresh id), None when the answer is plain text.

    Raises ValueError for an answer that starts a call but is not a complete one (cut by ``max_tokens``)."""
    body = text.strip()
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"the tool call is incomplete ({exc}); raise max_tokens") from None
    names = {t.name for t in tools}
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments"), dict):
        raise ValueError(f"not a call of a bound tool: {body[:200]}")
    return ToolCall(obj["name"], obj["arguments"], new_call_id())


def call_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) offsets of the JSON objects that follow each other in ``text`` (whitespace between them),
    from its first character on; [] when ``text`` does not start (after whitespace) with ``{``. An object cut
    short (``max_tokens``) after complete ones is left out (parallel calls: the complete calls stand), and so is an
    exact repeat of an earlier object (`call_key`); ValueError for a first object cut short, or text that is not
    such a sequence."""
    spans: list[tuple[int, int]] = []
    seen: set[str] = set()
    i = _skip_ws(text, 0)
    while i < len(text):
        if text[i] != "{":
            if not spans:
                return []
            raise ValueError(f"text after the tool calls: {text[i:i + 80]!r}")
        try:
            _, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError) as exc:
            if spans:
                return spans
            raise ValueError(f"the tool call is incomplete ({exc}); raise max_tokens") from None
        key = call_key(text[i:end])
        if key not in seen:  # an exact repeat of an earlier call is left out (small models loop on a call)
            seen.add(key)
            spans.append((i, end))
        i = _skip_ws(text, end)
    return spans


def calls_cut(text: str) -> bool:
    """True when ``text`` (a sequence of call objects) ends inside an object: the last call was cut short."""
    i = _skip_ws(text, 0)
    while i < len(text) and text[i] == "{":
        try:
            i = _skip_ws(text, _DECODER.raw_decode(text, i)[1])
        except (ValueError, RecursionError):
            return True
    return False


def call_key(obj_text: str) -> str:
    """What makes two calls the same call: the object's JSON, keys sorted (name and arguments alike)."""
    return json.dumps(json.loads(obj_text), sort_keys=True, ensure_ascii=False)


def parse_tool_calls(text: str, tools: Sequence[ToolSpec]) -> list[ToolCall]:
    """Every call in a finished answer, in order (fresh ids); [] when the answer is plain text. ValueError as
    `parse_tool_call`, for any of them."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    for start, end in call_spans(text):
        obj = json.loads(text[start:end])
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments"), dict):
            raise ValueError(f"not a call of a bound tool: {text[start:end][:200]}")
        calls.append(ToolCall(obj["name"], obj["arguments"], new_call_id()))
    return calls


_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class CallScan:
    """What `scan_tool_call` found in an answer that starts a call: the tool's name once its string is complete,
    where the arguments' JSON text starts once its key is written, and where it ends once the value is complete
    (offsets into the scanned text); ``complete``: the call object is closed."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    complete: bool = False


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def scan_tool_call(text: str) -> CallScan | None:
    """The top-level keys of a call object ``{"name": ..., "arguments": {...}}`` in ``text``, finished or not; None
    when ``text`` does not start (after whitespace) with ``{``. Values are read whole with the JSON decoder, so a
    name or an arguments object is reported only once complete; the arguments' start is known as soon as their
    key and colon are written (a stream sends the text from there as it grows)."""
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return None
    i += 1
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            break
        if text[i] == "}":
            return CallScan(name, args_start, args_end, complete=True)
        if text[i] == ",":
            i += 1
            continue
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] != ":" or not isinstance(key, str):
            break
        i = _skip_ws(text, i + 1)
        if key == "arguments" and i < len(text):
            args_start = i
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key == "arguments" and isinstance(value, dict):
            args_end = i
    return CallScan(name, args_start, args_end)
