"""Tool calls and structured prediction of `PCRLLM` on grammar-constrained decoding (`pcr_rag.structured`).

- `tool_specs`: LlamaIndex tools -> `ToolSpec`s; `tool_choice_of`: LlamaIndex's ``tool_required`` / ``tool_choice``
  -> "auto" | "any" | "none" | a tool name.
- `assistant_message`: a finished answer -> an assistant `ChatMessage` whose tool call (if any) is a `ToolCallBlock`
  and, for code that reads it there, ``additional_kwargs["tool_calls"]``.
- `history_turn`: a history message with tool calls, or a tool result, -> a chat turn.
- `GrammarProgram`: ``structured_predict`` and friends: the prompt's messages, ``output_cls``'s JSON schema as the
  response format (the model also sees the schema, after the conversation), the answer validated into
  ``output_cls``; streaming yields partial objects as the JSON grows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import process_streaming_objects
from llama_index.core.types import BasePydanticProgram, Model

from pcr_rag.response_format import ResponseFormat
from pcr_rag.structured import (
    ToolCall,
    ToolSpec,
    close_objects,
    new_call_id,
    normalize_tool_choice,
    parse_tool_calls,
    tool_history_turns,
)

if TYPE_CHECKING:
    from llama_index.core.prompts.base import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

__all__ = ["GrammarProgram", "assistant_message", "history_turn", "tool_choice_of", "tool_selections", "tool_specs"]


def tool_specs(tools: Sequence[BaseTool]) -> list[ToolSpec]:
    return [ToolSpec(t.metadata.get_name(), t.metadata.description or "", t.metadata.get_parameters_dict())
            for t in tools]


def tool_choice_of(specs: Sequence[ToolSpec], tool_required: bool, tool_choice: Any) -> str:
    """An explicit ``tool_choice`` ("auto", "any"/"required", "none", a name or an OpenAI dict) wins; otherwise
    ``tool_required`` means "any" and its absence "auto"."""
    if tool_choice is None:
        tool_choice = "any" if tool_required else "auto"
    return normalize_tool_choice(tool_choice, [s.name for s in specs])


def assistant_message(text: str, tools: Sequence[ToolSpec], raw: dict[str, Any] | None) -> ChatMessage:
    """The assistant message of a finished answer (``raw``: the request's metrics, as ``additional_kwargs["pcr"]``).
    An answer that starts a call but is incomplete (cut by ``max_new_tokens``) stays text."""
    extra: dict[str, Any] = {"pcr": raw} if raw is not None else {}
    calls: list[ToolCall] = []
    if tools:
        try:
            calls = parse_tool_calls(text, tools)
        except ValueError:
            calls = []
    if not calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text, additional_kwargs=extra)
    extra["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    blocks = [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=[TextBlock(text=""), *blocks], additional_kwargs=extra)


def _calls_of(message: ChatMessage) -> list[ToolCall]:
    calls = [ToolCall(b.tool_name, b.tool_kwargs if isinstance(b.tool_kwargs, dict) else _loads(b.tool_kwargs),
                      b.tool_call_id or new_call_id())
             for b in message.blocks if isinstance(b, ToolCallBlock)]
    if calls:
        return calls
    for c in message.additional_kwargs.get("tool_calls") or ():
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments", {})
        calls.append(ToolCall(fn.get("name", ""), args if isinstance(args, dict) else _loads(args),
                              c.get("id") or new_call_id()))
    return calls


def _loads(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    return [ToolSelection(tool_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in _calls_of(message)]


def history_turn(message: ChatMessage, role: str, names: dict[str, str], native: bool) -> dict[str, Any] | None:
    """A tool result or an assistant message with tool calls as a chat turn; None for any other message.
    ``names`` maps call ids to tool names (filled from assistant calls, read for results)."""
    text = message.content or ""
    if message.role == MessageRole.TOOL:
        call_id = message.additional_kwargs.get("tool_call_id")
        name = message.additional_kwargs.get("name") or names.get(call_id or "")
        return tool_history_turns("tool", text, tool_name=name, tool_call_id=call_id, native=native)
    if role != "assistant":
        return None
    calls = _calls_of(message)
    if not calls:
        return None
    names.update((c.id, c.name) for c in calls)
    return tool_history_turns("assistant", text, tool_calls=calls, native=native)


def schema_format(output_cls: type[BaseModel]) -> ResponseFormat:
    """``output_cls``'s JSON schema (objects closed) as a response format."""
    return ResponseFormat.json_schema(close_objects(output_cls.model_json_schema()))


class GrammarProgram(BasePydanticProgram[Model]):
    """Structured prediction through ``llm.chat`` with ``output_cls``'s schema as the response format."""

    def __init__(self, llm: Any, output_cls: type[Model], prompt: BasePromptTemplate) -> None:
        self._llm = llm
        self._output_cls = output_cls
        self._prompt = prompt
        self._format = schema_format(output_cls)

    @property
    def output_cls(self) -> type[Model]:
        return self._output_cls

    def _messages(self, kwargs: dict[str, Any]) -> list[ChatMessage]:
        return self._llm._extend_messages(self._prompt.format_messages(llm=self._llm, **kwargs))

    def _llm_kwargs(self, llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        return {**(llm_kwargs or {}), "response_format": self._format}

    def __call__(self, *args: Any, llm_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Model:
        response = self._llm.chat(self._messages(kwargs), **self._llm_kwargs(llm_kwargs))
        return self._output_cls.model_validate_json(response.message.content or "")

    async def acall(self, *args: Any, llm_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Model:
        response = await self._llm.achat(self._messages(kwargs), **self._llm_kwargs(llm_kwargs))
        return self._output_cls.model_validate_json(response.message.content or "")

    def stream_call(self, *args: Any, llm_kwargs: dict[str, Any] | None = None,
                    **kwargs: Any) -> Generator[Any, None, None]:
        """Partial objects (LlamaIndex's flexible models) as the JSON grows, then the validated object."""
        current = None
        last = None
        for response in self._llm.stream_chat(self._messages(kwargs), **self._llm_kwargs(llm_kwargs)):
            last = response
            current = self._partial(response, current)
            if current is not None:
                yield current
        if last is not None:
            yield self._output_cls.model_validate_json(last.message.content or "")

    async def astream_call(self, *args: Any, llm_kwargs: dict[str, Any] | None = None,
                           **kwargs: Any) -> AsyncGenerator[Any, None]:
        """As `stream_call`; awaited, it submits the request and returns the generator (as LlamaIndex awaits
        ``program.astream_call(...)`` before iterating)."""
        responses = await self._llm.astream_chat(self._messages(kwargs), **self._llm_kwargs(llm_kwargs))
        return self._astream(responses)

    async def _astream(self, responses: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        current = None
        last = None
        async for response in responses:
            last = response
            current = self._partial(response, current)
            if current is not None:
                yield current
        if last is not None:
            yield self._output_cls.model_validate_json(last.message.content or "")

    def _partial(self, response: Any, current: Any) -> Any:
        if not response.delta:
            return None
        try:
            return process_streaming_objects(response, self._output_cls,
                                             cur_objects=None if current is None else [current],
                                             flexible_mode=True, llm=self._llm)
        except Exception:  # noqa: BLE001 - a prefix that does not parse yet
            return None
