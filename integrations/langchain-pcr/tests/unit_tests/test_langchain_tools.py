"""ChatPCR tool calling and structured output on a real engine with the tiny random model: the grammar alone makes
every call and every object valid, whatever the weights."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_pcr import ChatPCR
from langchain_pcr.chat_models import to_chat_turns
from pydantic import BaseModel, ConfigDict, Field

from pcr_rag import InvalidRequestError
from pcr_rag.structured import ToolCall, template_renders_tool_calls, tool_history_turns
from pcr_rag.testing import tiny_tokenizer


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


@tool(args_schema=AddArgs)
def add(a: int, b: int) -> int:
    """Add two digits."""
    return a + b


class Pet(BaseModel):
    """A pet (bounded, so a random model's answer completes)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z]{1,6}$")
    kind: Literal["cat", "dog"]


DOC = "The heapq module keeps the smallest item of a list first; heappush adds an item. " * 4


@pytest.fixture
def chat(engine) -> ChatPCR:
    return ChatPCR(engine=engine, max_tokens=80)


def _args_ok(args: dict) -> bool:
    return set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values())


@pytest.mark.parametrize("choice", ["any", "add"])
def test_forced_calls_invoke_and_stream_agree(chat, choice) -> None:
    llm = chat.bind_tools([add], tool_choice=choice)
    msg = llm.invoke("What is 2 + 3?")
    [call] = msg.tool_calls
    assert call["name"] == "add" and _args_ok(call["args"]) and call["id"].startswith("call_")
    assert call["type"] == "tool_call" and msg.content == ""
    assert [b["type"] for b in msg.content_blocks] == ["tool_call"]
    full = None
    for chunk in llm.stream("What is 2 + 3?"):
        full = chunk if full is None else full + chunk
    assert full.tool_calls[0]["args"] == call["args"] and full.tool_calls[0]["name"] == "add"
    assert full.usage_metadata["output_tokens"] > 0


def test_none_and_auto(chat) -> None:
    plain = chat.bind_tools([add], tool_choice="none").invoke("What is 2 + 3?")
    assert plain.tool_calls == [] and isinstance(plain.content, str)
    auto = chat.bind_tools([add]).invoke("What is 2 + 3?")  # a call or text, never anything half-formed
    assert auto.invalid_tool_calls == [] and (auto.tool_calls or not auto.content.lstrip().startswith("{"))


def test_two_step_tool_loop(chat) -> None:
    question = HumanMessage("What is 2 + 3?")
    first = chat.bind_tools([add], tool_choice="any").invoke([question])
    result = add.invoke(first.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == first.tool_calls[0]["id"]
    final = chat.bind_tools([add], tool_choice="none").invoke([question, first, result])
    assert isinstance(final, AIMessage) and final.tool_calls == []


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_methods(chat, method) -> None:
    structured = chat.with_structured_output(Pet if method != "json_mode" else Pet.model_json_schema(),
                                             method=method, include_raw=True)
    out = structured.invoke("Describe a pet.")
    assert out["parsing_error"] is None or method == "json_mode"
    if method != "json_mode":
        assert isinstance(out["parsed"], Pet)
    assert isinstance(out["raw"], AIMessage)
    if method == "json_schema":
        assert list(chat.with_structured_output(Pet).stream("Describe a pet."))[-1] == out["parsed"]


def test_schema_errors_come_before_any_compute() -> None:
    class Tagged(BaseModel):
        tags: set[str]  # uniqueItems: the grammar compiler cannot enforce it

    llm = ChatPCR(model="smollm2-135m-instruct")
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        llm.bind_tools([Tagged], tool_choice="any")
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        llm.with_structured_output(Tagged)
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        llm.bind_tools([add], tool_choice="subtract")
    assert llm._holder.loaded is None


def test_structured_answers_reuse_document_kv(chat) -> None:
    """The schema goes after the documents: the second request over the same document reads its KV from the
    cache, whatever the schema."""
    question = [SystemMessage("Answer from the context."), HumanMessage(f"Context: {DOC}\nName a pet.")]
    chat.invoke(question, documents=[DOC], max_tokens=2)
    out = chat.with_structured_output(Pet, include_raw=True).invoke(question, documents=[DOC])
    assert isinstance(out["parsed"], Pet)
    assert out["raw"].usage_metadata["input_token_details"]["cache_read"] >= 32
    tools = chat.bind_tools([add], tool_choice="any").invoke(question, documents=[DOC])
    assert tools.usage_metadata["input_token_details"]["cache_read"] >= 32


def test_history_turns_fallback_and_native_formats() -> None:
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "abc123", "type": "tool_call"}
    history = [HumanMessage("What is 1 + 2?"),
               AIMessage([{"type": "text", "text": "Let me add."},
                          {"type": "tool_use", "id": "abc123", "name": "add", "input": {"a": 1, "b": 2}}],
                         tool_calls=[call]),
               ToolMessage(json.dumps({"result": 3}), tool_call_id="abc123"),
               ToolMessage("Error: b missing", tool_call_id="abc123", status="error")]
    assert to_chat_turns(history)[1:] == [
        {"role": "assistant", "content": 'Let me add.\n{"name": "add", "arguments": {"a": 1, "b": 2}}'},
        {"role": "user", "content": 'Result of add (call abc123): {"result": 3}'},
        {"role": "user", "content": "Error from add (call abc123): Error: b missing"}]
    native = to_chat_turns(history, native_tools=True)
    assert native[1]["tool_calls"] == [{"id": "abc123", "type": "function",
                                        "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert native[2] == {"role": "tool", "content": '{"result": 3}', "tool_call_id": "abc123", "name": "add"}


def test_native_tool_templates_are_detected() -> None:
    tok = tiny_tokenizer()
    assert not template_renders_tool_calls(tok)  # ChatML without tool support
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}<call>{{ c['function']['name'] }} "
        "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}\n{% endfor %}")
    assert template_renders_tool_calls(tok)
    turn = tool_history_turns("assistant", "", tool_calls=[ToolCall("add", {"a": 1}, "c1")], native=True)
    text = tok.apply_chat_template([turn], tokenize=False)
    assert '<call>add {"a": 1}</call>' in text
