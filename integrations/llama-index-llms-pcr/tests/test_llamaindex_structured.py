"""PCRLLM structured output and function calling on grammar-constrained decoding: the tiny random model (the
grammar alone makes its output valid), then the default model end to end (`slow`)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.pcr import PCRLLM, PCRRequestError
from llama_index.llms.pcr.base import to_chat_turns
from pydantic import BaseModel, ConfigDict, Field

from pcr_rag import EngineConfig


class Pet(BaseModel):
    """Bounded everywhere, so a random-weight model's answer always completes within the token budget."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z]{1,6}$")
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


def add(a: int, b: int) -> int:
    """Add two digits."""
    return a + b


def add_tool() -> FunctionTool:
    return FunctionTool.from_defaults(add, fn_schema=AddArgs)


PROMPT = PromptTemplate("Describe a pet called {name}.")


@pytest.fixture
def llm(engine) -> PCRLLM:
    return PCRLLM(engine=engine, max_new_tokens=120, retrieval_hook=False)


def test_structured_predict_sync_async_stream_and_structured_llm(llm) -> None:
    pet = llm.structured_predict(Pet, PROMPT, name="rex")
    assert isinstance(pet, Pet)
    assert asyncio.run(llm.astructured_predict(Pet, PROMPT, name="rex")) == pet  # greedy: same tokens
    parts = list(llm.stream_structured_predict(Pet, PROMPT, name="rex"))
    assert parts[-1] == pet and len(parts) > 1, "partial objects come before the final one"

    async def astream() -> list:
        return [p async for p in await llm.astream_structured_predict(Pet, PROMPT, name="rex")]

    aparts = asyncio.run(astream())
    assert aparts[-1] == pet and len(aparts) == len(parts)
    sllm = llm.as_structured_llm(Pet)
    response = sllm.chat([ChatMessage(role=MessageRole.USER, content="Describe a pet called rex.")])
    assert isinstance(response.raw, Pet)
    Pet.model_validate_json(response.message.content)


def test_structured_predict_rejects_a_schema_before_compute(llm, engine) -> None:
    class Tagged(BaseModel):
        tags: set[str]  # uniqueItems: the grammar compiler cannot enforce it

    with pytest.raises(PCRRequestError, match="uniqueItems"):
        llm.structured_predict(Tagged, PROMPT, name="rex")
    assert engine.executor.steps == 0


def test_chat_with_tools_forced_named_none_and_stream(llm) -> None:
    tool = add_tool()
    response = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_required=True)
    [call] = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "add" and call.tool_id.startswith("call_")
    assert set(call.tool_kwargs) == {"a", "b"} and 0 <= call.tool_kwargs["a"] <= 9
    assert json.loads(response.message.additional_kwargs["tool_calls"][0]["function"]["arguments"]) == \
        call.tool_kwargs
    named = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_choice="add")
    assert llm.get_tool_calls_from_response(named)[0].tool_kwargs == call.tool_kwargs
    last = None
    for last in llm.stream_chat_with_tools([tool], user_msg="What is 2 + 3?", tool_required=True):
        assert not last.delta, "a call is not streamed as text"
    assert llm.get_tool_calls_from_response(last)[0].tool_kwargs == call.tool_kwargs
    plain = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_choice="none")
    assert llm.get_tool_calls_from_response(plain, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(plain)
    with pytest.raises(PCRRequestError, match="tool_choice"):
        llm.chat_with_tools([tool], user_msg="hi", tool_choice="missing_tool")


def test_tool_history_is_rendered_and_answered(llm) -> None:
    tool = add_tool()
    first = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_required=True)
    [call] = llm.get_tool_calls_from_response(first)
    history = [ChatMessage(role=MessageRole.USER, content="What is 2 + 3?"), first.message,
               ChatMessage(role=MessageRole.TOOL, content=str(add(**call.tool_kwargs)),
                           additional_kwargs={"tool_call_id": call.tool_id})]
    turns = to_chat_turns(history)
    assert turns[1] == {"role": "assistant", "content": json.dumps({"name": "add", "arguments": call.tool_kwargs})}
    assert turns[2]["role"] == "user" and turns[2]["content"].startswith(f"Result of add (call {call.tool_id}): ")
    answer = llm.chat_with_tools([tool], chat_history=history, tool_choice="none")
    assert answer.message.content is not None


# ---------------------------------------------------------------------------------------------------- default model
class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


@pytest.fixture(scope="module")
def real_llm(tmp_path_factory) -> PCRLLM:
    config = EngineConfig(cache_dir=tmp_path_factory.mktemp("kv"), dram_capacity="256MiB", ssd_capacity=0)
    return PCRLLM(config=config, max_new_tokens=40, retrieval_hook=False)


@pytest.mark.slow
def test_default_model_structured_predict_returns_a_valid_instance(real_llm) -> None:
    city = real_llm.structured_predict(City, PromptTemplate("Name the capital of {country} as JSON."),
                                       country="France")
    assert isinstance(city, City) and city.name and city.country


@pytest.mark.slow
def test_default_model_function_agent_loop_completes(real_llm) -> None:
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult

    def multiply(a: int, b: int) -> int:
        """Multiply two integers and return the product."""
        return a * b

    agent = FunctionAgent(tools=[FunctionTool.from_defaults(multiply)], llm=real_llm,
                          initial_tool_choice="multiply", system_prompt="You are a calculator; use the tool.")

    async def run() -> tuple[list[ToolCallResult], str]:
        handler = agent.run("What is 6 times 7?", max_iterations=12)
        results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
        return results, str(await handler)

    results, answer = asyncio.run(run())
    assert results and results[0].tool_name == "multiply"
    assert results[0].tool_output.content == str(multiply(**results[0].tool_kwargs))
    assert isinstance(answer, str)
